"""Offloading settings of the ``nosa`` backend, read from the environment in every SGLang process.

SGLang's command line belongs to SGLang, and the plugin runs in the launcher and in every
subprocess, so the settings are environment variables (like ``NOSA_CONFIG``):

- ``NOSA_OFFLOAD``: ``1`` keeps the KV in host memory (off, the default: the KV stays in SGLang's
  device pool and none of the offloading engine is built);
- ``NOSA_HOST_KV_TOKENS``: host KV capacity in tokens. It becomes SGLang's KV pool size, so the
  scheduler's admission, chunked prefill, input-length limit and leak checks count host tokens;
- ``NOSA_DEVICE_KV_TOKENS``: the one device KV budget, in tokens (K and V of every layer, like
  SGLang's ``--max-total-tokens``), shared by all requests. A request holds
  ``slots_per_head * block_size`` tokens of it for its whole life, whatever its context length;
  the budget therefore caps the number of requests running at once (``max_requests``);
- ``NOSA_DEVICE_EXTRA_SLOTS`` (default 0): block slots per (request, KV head) beyond
  ``topk_blocks``; a spare slot keeps a dropped block resident, so it is a hit if it comes back.
  With ``NOSA_ADMISSION=1`` it is the most a request may borrow (nosa.serve.offload.admission);
- ``NOSA_RECALL_SCHEDULER`` (default 0): ``1`` moves recall to the interruptible layer-wise
  scheduler (nosa.serve.offload.recall): a layer still copies its own misses inline, but the next
  layer's predicted blocks are prefetched on a worker while a layer computes, and that prefetch
  pauses whenever a layer copies its misses; ``NOSA_RECALL_CHUNK_ITEMS`` (default 64) items per
  chunk;
- ``NOSA_ADMISSION`` (default 0): ``1`` turns on I/O-adaptive admission (nosa.serve.offload.admission):
  each request owns ``topk_blocks`` slots (so the budget holds more requests), extra slots are
  lent from idle requests' slots, and new requests wait while their recall could not be hidden.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from nosa.config import NosaConfig

ENV_OFFLOAD = "NOSA_OFFLOAD"
ENV_HOST_TOKENS = "NOSA_HOST_KV_TOKENS"
ENV_DEVICE_TOKENS = "NOSA_DEVICE_KV_TOKENS"
ENV_EXTRA_SLOTS = "NOSA_DEVICE_EXTRA_SLOTS"
ENV_SCHEDULE = "NOSA_RECALL_SCHEDULER"
ENV_CHUNK = "NOSA_RECALL_CHUNK_ITEMS"
ENV_ADMISSION = "NOSA_ADMISSION"


def offload_enabled() -> bool:
    return _bool_env(ENV_OFFLOAD)


def _bool_env(name: str) -> bool:
    value = os.environ.get(name, "0").strip().lower()
    if value not in ("0", "1", "", "false", "true", "off", "on"):
        raise ValueError(f"nosa backend: ${name}={value!r} must be 1 (on) or 0 (off)")
    return value in ("1", "true", "on")


def _int_env(name: str, default: int | None = None, minimum: int = 1) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        if default is None:
            raise ValueError(f"nosa backend: ${ENV_OFFLOAD}=1 needs ${name} (tokens, an integer >= {minimum})")
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"nosa backend: ${name}={text!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"nosa backend: ${name}={value} must be >= {minimum}")
    return value


@dataclass(frozen=True)
class OffloadSettings:
    host_tokens: int
    device_tokens: int
    extra_slots: int = 0
    schedule: bool = False
    chunk_items: int = 64
    admission: bool = False

    @classmethod
    def from_env(cls) -> "OffloadSettings":
        return cls(
            host_tokens=_int_env(ENV_HOST_TOKENS),
            device_tokens=_int_env(ENV_DEVICE_TOKENS),
            extra_slots=_int_env(ENV_EXTRA_SLOTS, default=0, minimum=0),
            schedule=_bool_env(ENV_SCHEDULE),
            chunk_items=_int_env(ENV_CHUNK, default=64),
            admission=_bool_env(ENV_ADMISSION),
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
    import psutil

    available = psutil.virtual_memory().available
    if host_bytes > 0.9 * available:
        raise ValueError(
            f"nosa backend: the host KV pool ({what}) needs {host_bytes / 2**30:.2f} GiB but only "
            f"{available / 2**30:.2f} GiB of host memory is available; lower ${ENV_HOST_TOKENS}"
        )
