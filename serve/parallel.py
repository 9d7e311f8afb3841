"""The parallel layout of a serving process: which KV heads a tensor-parallel rank holds, the
layouts nosa refuses, the per-rank stats file, and SGLang's tensor-parallel start-up on CPU.

``KVHeadShard``: ``--tp-size N`` splits the KV heads as SGLang's QKVParallelLinear does (a
contiguous run of heads / N per rank, or each head replicated on N / heads ranks; SGLang's CPU path
pads them to a multiple of N with zero heads that are no real KV heads). Each rank keeps its own
decode states, host pool and device slots; eviction heads sum partial projections across ranks
(nosa.serve.sharded_eviction). ``--dp-size N`` replicas share nothing. ``install`` (the plugin, in
every process, CPU only) passes ``use_pynccl=False`` to SGLang's ``init_model_parallel_group``,
which asks for a PyNccl communicator (a CUDA device) even without an accelerator, so SGLang's
all-reduce falls back to torch.distributed over gloo.
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
from dataclasses import dataclass

import torch

from nosa.serve.offload.settings import ENV_ADMISSION, OffloadSettings, offload_enabled

logger = logging.getLogger(__name__)

_GROUP_FACTORY = "sglang.srt.distributed.parallel_state.init_model_parallel_group"
_INSTALLED = []  # the plugin's register() may run more than once in a process


@dataclass(frozen=True)
class KVHeadShard:
    """The KV heads of one tensor-parallel rank.

    total: the KV heads SGLang lays out (the model's, or more where SGLang's CPU path pads them to
    a multiple of ``size``); real: the model's own KV heads, ``0 .. real - 1`` (the eviction head's
    outputs), the others are padding; rank, size: the rank and width of the attention TP group.
    """

    total: int
    real: int
    rank: int = 0
    size: int = 1

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"KVHeadShard: rank {self.rank} is not a rank of {self.size}")
        if not 0 < self.real <= self.total:
            raise ValueError(f"KVHeadShard: real heads {self.real} must be in 1..total heads {self.total}")
        if self.total % self.size and self.size % self.total:
            raise ValueError(f"KVHeadShard: {self.total} KV heads cannot be split over {self.size} ranks "
                             "(one must divide the other)")

    @property
    def replicas(self) -> int:
        """Ranks holding each head (1 unless there are fewer heads than ranks)."""
        return max(1, self.size // self.total)

    def heads(self, rank: int | None = None) -> range:
        """The heads ``rank`` (default: this one) holds, in the order of its KV [T, local, D]."""
        rank = self.rank if rank is None else rank
        per_rank = max(1, self.total // self.size)
        first = (rank // self.replicas) * per_rank
        return range(first, first + per_rank)

    @property
    def local(self) -> int:
        """KV heads this rank holds (what SGLang's layer and pool call tp_k_head_num / head_num)."""
        return len(self.heads())

    def real_heads(self, rank: int | None = None) -> list[int]:
        return [h for h in self.heads(rank) if h < self.real]

    @property
    def counts(self) -> bool:
        """Whether this rank's value heads enter the all-reduced sums: the first replica of each
        head only, so a replicated head is counted once."""
        return self.rank % self.replicas == 0

    @property
    def communicates(self) -> bool:
        """Whether some rank holds some real heads but not all of them: only then does an eviction
        head need the other ranks' value heads (never with one rank or one real head)."""
        return any(0 < len(self.real_heads(r)) < self.real for r in range(self.size))

    @classmethod
    def of_process(cls, text_config, server_args) -> "KVHeadShard":
        """This SGLang scheduler process's shard, after ``check_layout`` accepted its layout."""
        from sglang.srt.runtime_context import get_parallel  # optional: sglang (an SGLang scheduler's ranks)

        check_layout(server_args)
        total = text_config.num_key_value_heads
        real = getattr(text_config, "original_total_num_kv_heads", total)  # set where SGLang padded them
        parallel = get_parallel()
        shard = cls(total=total, real=real, rank=parallel.attn_tp_rank, size=parallel.attn_tp_size)
        if shard.size > 1:
            logger.info("nosa backend: TP rank %d of %d holds KV heads %s of %d (%d real); eviction heads %s",
                        shard.rank, shard.size, list(shard.heads()), total, real,
                        "all-reduce partial sums" if shard.communicates else "need no other rank")
        return shard


def check_layout(server_args) -> None:
    """Refuse, naming the flag, the parallel layouts nosa does not serve (ValueError)."""
    refused = {  # server_args field: (flag, what it is)
        "pp_size": ("--pp-size", "pipeline parallelism: the backend keeps every layer's state in one process"),
        "attn_cp_size": ("--attn-cp-size", "attention context parallelism"),
        "dcp_size": ("--dcp-size", "decode context parallelism"),
    }
    for field, (flag, what) in refused.items():
        value = getattr(server_args, field, 1) or 1
        if value > 1:
            raise ValueError(f"nosa backend: {flag} {value} is not supported ({what}); use --tp-size or --dp-size")
    if getattr(server_args, "enable_dp_attention", False):
        raise ValueError("nosa backend: --enable-dp-attention is not supported; use --tp-size or --dp-size")
    if server_args.tp_size > 1 and offload_enabled() and OffloadSettings.from_env().admission:
        raise ValueError(
            f"nosa backend: ${ENV_ADMISSION}=1 decides from this rank's own timings, and the schedulers of "
            f"tensor-parallel ranks must take the same decisions; run --tp-size {server_args.tp_size} without "
            f"it, or admission with --dp-size"
        )


def rank_path(path: str | None) -> str | None:
    """A file one process writes, made per rank where the server has several: ``stats.json`` is
    ``stats.tp1.json`` for TP rank 1, ``stats.dp0.json`` for replica 0, ``stats.dp0.tp1.json``
    with both. Unchanged with one rank (or outside an SGLang scheduler)."""
    if not path:
        return path
    tp_rank, tp_size, dp_rank = process_ranks()
    parts = ([f"dp{dp_rank}"] if dp_rank is not None else []) + ([f"tp{tp_rank}"] if tp_size > 1 else [])
    if not parts:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.{'.'.join(parts)}{ext}"


def process_ranks() -> tuple[int, int, int | None]:
    """(tp_rank, tp_size, dp_rank or None) of this SGLang process; (0, 1, None) outside one."""
    if "sglang.srt.runtime_context" not in sys.modules:  # not an SGLang process: nothing to read
        return 0, 1, None
    from sglang.srt.runtime_context import get_parallel  # optional: sglang

    parallel = get_parallel()
    try:
        return parallel.tp_rank, parallel.tp_size, parallel.dp_rank
    except (RuntimeError, ValueError):  # SGLang raises these for ranks it has not published
        return 0, 1, None


def install() -> None:
    """On a machine without an accelerator: SGLang's process groups without PyNccl (once)."""
    if _INSTALLED or torch.accelerator.is_available():
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # optional: sglang

    HookRegistry.register(_GROUP_FACTORY, group_without_pynccl, HookType.AROUND)
    _INSTALLED.append(True)


def group_without_pynccl(original, *args, **kwargs):
    """``init_model_parallel_group`` with ``use_pynccl=False``: PyNccl needs a CUDA device."""
    call = inspect.signature(original).bind(*args, **kwargs)
    call.arguments["use_pynccl"] = False
    return original(*call.args, **call.kwargs)
