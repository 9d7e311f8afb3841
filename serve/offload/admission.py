"""I/O-adaptive admission for the offloading engine ($NOSA_ADMISSION=1 with $NOSA_OFFLOAD=1).

``Admission`` decides from measurements (each decision counted in ``decisions``, logged at debug):
the link bandwidth ``bw`` (seeded by ``probe_bandwidth``, updated by every recall, an EMA of weight
``alpha``); ``compute``, a decode step's time without its stalls, so ``hideable = headroom * bw *
compute`` bytes of recall per step can move while layers compute; per request (device group g) the
bytes it recalls per step ``misses[g]`` and its context ``blocks[g]``. ``grants``: free columns lent
as extra slots (at most ``max_extra``), first to requests they make fully resident, then by misses.
``allowed_new``: new offloaded requests wait while the running requests' recall plus one more
(their mean, or the locality bound before any measurement) exceeds ``hideable``; with nothing
running one is admitted. SGLang applies it through the ``Scheduler.get_num_allocatable_reqs`` hook
(``register_hooks``; 0 keeps the queue waiting). The engine (nosa.serve.offload.engine) feeds the
measurements after every decode step and applies the grants to the block cache.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from nosa import ops

logger = logging.getLogger(__name__)

PROBE_ITEMS = 256
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"


@dataclass(frozen=True)
class AdmissionPolicy:
    headroom: float = 0.8  # share of a step's compute time that recall may fill
    alpha: float = 0.2  # weight of the newest sample in the running estimates
    max_extra: int = 0  # extra slots per (request, KV head) at most

    def __post_init__(self):
        if not 0 < self.headroom <= 1:
            raise ValueError(f"AdmissionPolicy.headroom must be in (0, 1], got {self.headroom}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"AdmissionPolicy.alpha must be in (0, 1], got {self.alpha}")
        if self.max_extra < 0:
            raise ValueError(f"AdmissionPolicy.max_extra must be >= 0, got {self.max_extra}")


class Admission:
    """The decisions of the documented policy from measured bandwidth, step time and misses.

    item_bytes: bytes of one (block, KV head) item; topk: slots a request always has; bound_items:
    items one request recalls per step at most in steady state (the locality bound, all layers)."""

    def __init__(self, policy: AdmissionPolicy, item_bytes: int, topk: int, bound_items: int,
                 bandwidth: float | None = None):
        self.policy, self.item_bytes, self.topk, self.bound_items = policy, item_bytes, topk, bound_items
        self.bw = bandwidth  # bytes / s
        self.compute = None  # s per decode step without stalls
        self.misses: dict[int, float] = {}  # group -> bytes per step
        self.blocks: dict[int, int] = {}  # group -> context blocks
        self.extra: dict[int, int] = {}  # group -> extra slots granted
        self.decisions = {"admit": 0, "wait": 0, "grant": 0, "revoke": 0, "resident": 0, "offloaded": 0}
        self._last_allowed = None

    # ---- measurements ------------------------------------------------------------------------
    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        self.bw = nbytes / seconds if self.bw is None else _ema(self.bw, nbytes / seconds, self.policy.alpha)

    def observe_step(self, compute_seconds: float, recalled: dict[int, int], blocks: dict[int, int]) -> None:
        """One decode step: its compute time (wall minus stall), bytes recalled per group, context
        blocks per group (the groups of the batch)."""
        a = self.policy.alpha
        self.compute = compute_seconds if self.compute is None else _ema(self.compute, compute_seconds, a)
        for g, nbytes in recalled.items():
            self.misses[g] = float(nbytes) if g not in self.misses else _ema(self.misses[g], nbytes, a)
        self.blocks.update(blocks)

    def forget(self, group: int) -> None:
        """The group's request left: its measurements and grant go."""
        self.misses.pop(group, None)
        self.blocks.pop(group, None)
        self.extra.pop(group, None)

    # ---- decisions ---------------------------------------------------------------------------
    def hideable(self) -> float:
        """Bytes per step that recall may move while layers compute (inf before measurements)."""
        if self.bw is None or self.compute is None:
            return math.inf
        return self.policy.headroom * self.bw * self.compute

    def resident(self, group: int) -> bool:
        return self.blocks.get(group, math.inf) <= self.topk + self.extra.get(group, 0)

    def demand(self) -> float:
        """Bytes per step the running offloaded requests recall."""
        return sum(m for g, m in self.misses.items() if not self.resident(g))

    def allowed_new(self, running: int) -> int:
        """How many new requests may start now (SGLang's own limit applies on top)."""
        if running == 0:
            allowed = 1 << 30
        else:
            offloaded = [m for g, m in self.misses.items() if not self.resident(g)]
            estimate = sum(offloaded) / len(offloaded) if offloaded else self.bound_items * self.item_bytes
            slack = self.hideable() - self.demand()
            allowed = 1 << 30 if math.isinf(slack) else max(0, int(slack // max(estimate, 1.0)))
        self.decisions["admit" if allowed > 0 else "wait"] += 1
        if allowed != self._last_allowed:
            logger.debug("nosa admission: running %d, bw %s B/s, compute %s s, hideable %.0f B/step, demand %.0f "
                         "B/step -> allowed_new %d", running, self.bw, self.compute, self.hideable(), self.demand(),
                         allowed)
            self._last_allowed = allowed
        return allowed

    def grants(self, spare: int) -> dict[int, int]:
        """Extra slots per running group from ``spare`` free slot columns (policy point 5)."""
        cap = self.policy.max_extra
        grants = {g: 0 for g in self.blocks}
        need = sorted((max(0, n - self.topk), g) for g, n in self.blocks.items())
        for extra, g in need:  # fully resident with a few extra slots: cheapest first
            if 0 < extra <= min(cap, spare):
                grants[g], spare = extra, spare - extra
        for _, g in sorted(((-self.misses.get(g, 0.0), g) for g in self.blocks)):
            if self.blocks[g] <= self.topk + grants[g]:
                continue
            more = min(cap - grants[g], spare)
            grants[g] += more
            spare -= more
        for g, n in grants.items():
            before = self.extra.get(g, 0)
            if n != before:
                self.decisions["grant" if n > before else "revoke"] += 1
                logger.debug("nosa admission: group %d extra slots %d -> %d (blocks %d, misses %.0f B/step)",
                             g, before, n, self.blocks[g], self.misses.get(g, 0.0))
        self.extra = grants
        self.decisions["resident"] = sum(self.resident(g) for g in self.blocks)
        self.decisions["offloaded"] = len(self.blocks) - self.decisions["resident"]
        return grants

    def snapshot(self) -> dict:
        return {"bandwidth_bytes_per_s": self.bw, "compute_s_per_step": self.compute,
                "hideable_bytes_per_step": None if math.isinf(self.hideable()) else self.hideable(),
                "demand_bytes_per_step": self.demand(), "extra_slots": {str(g): n for g, n in self.extra.items()},
                "decisions": dict(self.decisions)}


def _ema(old: float, new: float, alpha: float) -> float:
    return (1 - alpha) * old + alpha * new


def probe_bandwidth(dst, src, items: int = PROBE_ITEMS) -> tuple[float, int, float]:
    """(bytes/s, bytes, seconds) of one batched recall of ``items`` items src -> dst (copy_items)."""
    n = min(items, dst[0].shape[0], src[0].shape[0])
    idx = torch.arange(n)
    ops.copy_items(dst, src, idx, idx)  # warm-up (staging buffers, kernel compile)
    if dst[0].is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    ops.copy_items(dst, src, idx, idx)
    if dst[0].is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    nbytes = n * sum(t[0].numel() * t.element_size() for t in dst)
    return nbytes / max(seconds, 1e-9), nbytes, seconds


def controller_of(scheduler) -> Admission | None:
    """The admission controller of the nosa backend that ``scheduler`` (SGLang's Scheduler) runs its
    model with; None when that backend does not offload with admission."""
    engine = getattr(scheduler.tp_worker.model_runner.attn_backend, "offload", None)
    return None if engine is None else engine.admission


def register_hooks() -> None:
    """Hold new requests back through SGLang's scheduler while the controller says wait."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType  # optional: sglang

    def allocatable(original, self, running_bs, *args, **kwargs):
        n = original(self, running_bs, *args, **kwargs)
        control = controller_of(self)
        if control is None or n <= 0:
            return n
        return min(n, control.allowed_new(running_bs))

    HookRegistry.register(f"{_SCHEDULER}.get_num_allocatable_reqs", allocatable, HookType.AROUND)


def verify_hooks() -> None:
    """Start-up check (the backend calls it): the scheduler hook took effect in this process."""
    from sglang.srt.managers.scheduler import Scheduler  # optional: sglang

    if getattr(Scheduler.get_num_allocatable_reqs, "__wrapped__", None) is None:
        raise RuntimeError(f"nosa admission: the hook {_SCHEDULER}.get_num_allocatable_reqs did not take effect "
                           "with this SGLang version; run without $NOSA_ADMISSION")
