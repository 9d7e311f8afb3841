"""Offloading settings of the ``nosa`` backend, read from the environment in every SGLang process.

SGLang's command line belongs to SGLang, and the plugin runs in the launcher and in every
subprocess, so the settings are environment variables, read through nosa.env (whose ``VARIABLES``
say what each means): $NOSA_OFFLOAD (on/off), $NOSA_HOST_KV_TOKENS and $NOSA_DEVICE_KV_TOKENS
(required with offloading), $NOSA_DEVICE_EXTRA_SLOTS, $NOSA_RECALL_SCHEDULER,
$NOSA_RECALL_CHUNK_ITEMS, $NOSA_ADMISSION and $NOSA_HOST_KV_DTYPE. A malformed value raises ValueError naming the
variable, the value and what is expected.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from nosa import env
from nosa.config import NosaConfig

ENV_OFFLOAD = "NOSA_OFFLOAD"
ENV_HOST_TOKENS = "NOSA_HOST_KV_TOKENS"
ENV_DEVICE_TOKENS = "NOSA_DEVICE_KV_TOKENS"
ENV_EXTRA_SLOTS = "NOSA_DEVICE_EXTRA_SLOTS"
ENV_SCHEDULE = "NOSA_RECALL_SCHEDULER"
ENV_CHUNK = "NOSA_RECALL_CHUNK_ITEMS"
ENV_ADMISSION = "NOSA_ADMISSION"
ENV_HOST_DTYPE = "NOSA_HOST_KV_DTYPE"


def offload_enabled() -> bool:
    with backend_errors():
        return env.flag(ENV_OFFLOAD)


@contextmanager
def backend_errors():
    """nosa.env's ValueErrors (naming the variable, its value, what is expected), prefixed as the
    backend's other start-up errors are."""
    try:
        yield
    except ValueError as err:
        raise ValueError(f"nosa backend: {err}") from None


def _required(name: str, value: int | None) -> int:
    if value is None:
        raise ValueError(f"${ENV_OFFLOAD}=1 needs ${name} (tokens, an integer >= 1)")
    return value


@dataclass(frozen=True)
class OffloadSettings:
    host_tokens: int  # $NOSA_HOST_KV_TOKENS
    device_tokens: int  # $NOSA_DEVICE_KV_TOKENS
    extra_slots: int = 0  # $NOSA_DEVICE_EXTRA_SLOTS
    schedule: bool = False  # $NOSA_RECALL_SCHEDULER
    chunk_items: int = 64  # $NOSA_RECALL_CHUNK_ITEMS
    admission: bool = False  # $NOSA_ADMISSION
    host_kv_dtype: str = "auto"  # $NOSA_HOST_KV_DTYPE (nosa.kvquant.host_kv_dtype reads it)

    @classmethod
    def from_env(cls) -> "OffloadSettings":
        with backend_errors():
            return cls(
                host_tokens=_required(ENV_HOST_TOKENS, env.integer(ENV_HOST_TOKENS, minimum=1)),
                device_tokens=_required(ENV_DEVICE_TOKENS, env.integer(ENV_DEVICE_TOKENS, minimum=1)),
                extra_slots=env.integer(ENV_EXTRA_SLOTS, minimum=0),
                schedule=env.flag(ENV_SCHEDULE),
                chunk_items=env.integer(ENV_CHUNK, minimum=1),
                admission=env.flag(ENV_ADMISSION),
                host_kv_dtype=env.choice(ENV_HOST_DTYPE),
            )

    def home_slots(self, cfg: NosaConfig) -> int:
        """Slots a request owns for its whole life: all of them, or with admission only the budget
        (extra slots are then borrowed from idle requests)."""
        return cfg.topk_blocks if self.admission else self.slots_per_head(cfg)

    def slots_per_head(self, cfg: NosaConfig) -> int:
        """Device block slots of one (request, KV head): the budget (the block being filled is always
        one of them: the window includes the current block) plus the spare slots."""
        return cfg.topk_blocks + self.extra_slots

    def max_requests(self, cfg: NosaConfig) -> int:
        """Requests whose block slots fit the device budget at once."""
        return self.device_tokens // (self.home_slots(cfg) * cfg.block_size)

    def validate(self, cfg: NosaConfig, page_size: int) -> None:
        """Reject settings that cannot work, naming the setting. Called at start-up."""
        if page_size != cfg.block_size:
            raise ValueError(
                f"nosa backend: offloading stores one NOSA block per SGLang page, so --page-size must "
                f"equal NosaConfig.block_size={cfg.block_size} (got --page-size {page_size})"
            )
        if cfg.dense_len > cfg.budget_tokens:
            raise ValueError(
                f"nosa backend: with offloading, NosaConfig.dense_len={cfg.dense_len} must be <= the "
                f"budget topk_blocks * block_size = {cfg.budget_tokens}: a dense request keeps all its "
                "blocks in its device slots"
            )
        footprint = self.home_slots(cfg) * cfg.block_size
        if self.max_requests(cfg) < 1:
            raise ValueError(
                f"nosa backend: ${ENV_DEVICE_TOKENS}={self.device_tokens} is below one request's device "
                f"footprint of {footprint} tokens ((topk_blocks {cfg.topk_blocks} + "
                f"${ENV_EXTRA_SLOTS} {self.extra_slots}) x block_size {cfg.block_size})"
            )
        if self.host_tokens < footprint:
            raise ValueError(
                f"nosa backend: ${ENV_HOST_TOKENS}={self.host_tokens} is below one request's device "
                f"footprint ({footprint} tokens); the host pool must hold at least that"
            )


def check_host_memory(host_bytes: int, what: str) -> None:
    """Fail at start-up, with the numbers, when the host pool cannot fit in free RAM."""
    import psutil  # optional: psutil (SGLang's dependency, not nosa's)

    available = psutil.virtual_memory().available
    if host_bytes > 0.9 * available:
        raise ValueError(
            f"nosa backend: the host KV pool ({what}) needs {host_bytes / 2**30:.2f} GiB but only "
            f"{available / 2**30:.2f} GiB of host memory is available; lower ${ENV_HOST_TOKENS}"
        )
