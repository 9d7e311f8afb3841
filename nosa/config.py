"""NosaConfig: the one configuration object of NOSA attention.

It flows unchanged from the command line to the attention modules, into W&B, into the checkpoint's
``config.json`` (key ``nosa``), and back out of the checkpoint in the server.

Units: ``block_size``, ``compress_kernel``, ``compress_stride`` and ``dense_len`` are tokens;
``sink_blocks``, ``window_blocks``, ``topk_blocks`` and ``query_blocks`` are blocks.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

CONFIG_KEY = "nosa"  # where the config lives inside a Hugging Face config.json


@dataclass(frozen=True)
class NosaConfig:
    """Block-sparse attention with a bounded per-step change of the selected blocks.

    Per decode step and KV head the selection is
    ``sink_blocks`` sink blocks + ``window_blocks`` local blocks (the current, partial block included)
    + ``query_blocks`` free query-aware picks + the rest of the ``topk_blocks`` budget filled by the
    query-agnostic eviction score. Contexts of at most ``dense_len`` tokens use dense attention.

    Defaults are the released NOSA values (thunlp/NOSA: block 64, kernel 32, stride 16, 1 sink, a
    window of the current block and the 16 before it = 17 blocks, 64 total, 15 free picks, so the
    query-aware set is 1 + 17 + 15 = 33 blocks and the locality bound is 15 + 1 = 16 blocks per
    step); ``dense_len`` defaults to the budget in tokens (4096), below which a sparse selection
    would pick every block anyway.
    """

    block_size: int = 64  # tokens per block: the unit the selection picks
    compress_kernel: int = 32  # tokens per compressed window (the mean keys that score blocks for a query)
    compress_stride: int = 16  # tokens between the starts of two compressed windows
    sink_blocks: int = 1  # blocks at the start of the context, always selected
    window_blocks: int = 17  # local blocks always selected, the current (partial) block included
    topk_blocks: int = 64  # the budget: blocks each query row attends to, per KV head
    query_blocks: int = 15  # free query-aware picks beyond sinks and window (locality bound: this + 1 per step)
    dense_len: int = 4096  # contexts of at most this many tokens use dense attention

    def __post_init__(self) -> None:
        for name in ("block_size", "compress_kernel", "compress_stride", "window_blocks", "topk_blocks"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("sink_blocks", "query_blocks", "dense_len"):
            _check_int(name, getattr(self, name), minimum=0)
        if self.compress_kernel % self.compress_stride:
            raise ValueError(
                f"NosaConfig.compress_kernel={self.compress_kernel} must be a multiple of "
                f"compress_stride={self.compress_stride}"
            )
        if self.block_size % self.compress_stride:
            raise ValueError(
                f"NosaConfig.block_size={self.block_size} must be a multiple of "
                f"compress_stride={self.compress_stride} (compressed windows must align with blocks)"
            )
        forced_and_free = self.sink_blocks + self.window_blocks + self.query_blocks
        if self.topk_blocks < forced_and_free:
            raise ValueError(
                f"NosaConfig.topk_blocks={self.topk_blocks} is smaller than sink_blocks + window_blocks"
                f" + query_blocks = {self.sink_blocks} + {self.window_blocks} + {self.query_blocks}"
                f" = {forced_and_free}; the budget must hold the forced blocks and the free picks"
            )
        spill = self.compress_kernel - self.compress_stride
        if spill > (self.window_blocks - 1) * self.block_size:
            raise ValueError(
                f"NosaConfig.compress_kernel - compress_stride = {spill} tokens must be <= "
                f"(window_blocks - 1) * block_size = {(self.window_blocks - 1) * self.block_size}: "
                "a block's pooled scores must be final before it leaves the local window, "
                "otherwise eviction scores are not static and the locality bound fails"
            )

    # ---- derived sizes -------------------------------------------------------------------------
    @property
    def forced_blocks(self) -> int:
        """Sink + window blocks once the context is long enough."""
        return self.sink_blocks + self.window_blocks

    @property
    def budget_tokens(self) -> int:
        return self.topk_blocks * self.block_size

    @property
    def max_blocks_entering_per_step(self) -> int:
        """The locality bound: free picks + the one new block of the window (see nosa.select)."""
        return self.query_blocks + 1

    def num_blocks(self, length: int) -> int:
        """Blocks holding ``length`` tokens (the last one may be partial)."""
        return -(-length // self.block_size)

    def num_compressed(self, length: int) -> int:
        """Complete compressed windows among ``length`` tokens."""
        if length < self.compress_kernel:
            return 0
        return (length - self.compress_kernel) // self.compress_stride + 1

    # ---- (de)serialisation ---------------------------------------------------------------------
    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "NosaConfig":
        if not isinstance(data, dict):
            raise ValueError(f"NosaConfig must be a mapping, got {type(data).__name__}: {data!r}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"NosaConfig: unknown field(s) {unknown}; known fields are {sorted(known)}")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "NosaConfig":
        return cls.from_dict(json.loads(text))

    @classmethod
    def tiny(cls, **overrides: int) -> "NosaConfig":
        """A small preset for tests and CPU demos: blocks of 16 tokens, an 8-block budget."""
        values = dict(
            block_size=16,
            compress_kernel=8,
            compress_stride=4,
            sink_blocks=1,
            window_blocks=2,
            topk_blocks=8,
            query_blocks=2,
            dense_len=0,
        )
        values.update(overrides)
        return cls(**values)


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"NosaConfig.{name} must be an int, got {type(value).__name__}: {value!r}")
    if value < minimum:
        rule = "positive" if minimum == 1 else "non-negative"
        raise ValueError(f"NosaConfig.{name}={value} must be {rule} (>= {minimum})")
