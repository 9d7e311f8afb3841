"""Interruptible, layer-wise recall scheduling for the offloading engine ($NOSA_RECALL_SCHEDULER=1).

The device block cache hands its copies (host pool items -> device slots, nosa.ops.copy_items index
lists) to one ``RecallScheduler``: ``submit`` queues a transfer, split into chunks of ``chunk_items``
items that a worker thread copies one at a time, the oldest DEMAND first, else the oldest PREFETCH
(a demand preempts a prefetch at its next chunk boundary); ``demand`` copies a layer's misses in the
calling thread while the worker pauses; ``wait(layer)`` blocks until that layer's demand transfers
are done; ``claim(transfer)``, when the prefetch's layer resolves, drops the chunks not started,
waits for the one in flight and returns how many items landed (a prefix of the index list), so
what a layer reads never depends on timing. On CUDA the chunks run on a side copy stream with
events. ``delay`` (seconds, or callable(kind, layer)) is injected before every chunk (tests).
``stats``: per layer recall seconds and items per kind, stall seconds, preemptions, resumed
prefetches, dropped prefetch items.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from nosa import ops

DEMAND, PREFETCH = "demand", "prefetch"


@dataclass(eq=False)
class Transfer:
    """One copy job: item dst_idx[m] of every dst[i] <- src_idx[m] of src[i] (copy_items semantics)."""

    layer: int
    kind: str
    dst: list
    src: list
    dst_idx: torch.Tensor  # [M] int64, -1 padded
    src_idx: torch.Tensor
    chunk: int
    next: int = 0  # first item not yet started
    landed: int = 0  # items [0, landed) are copied
    cancelled: bool = False
    started: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    cuda_event: object = None
    error: BaseException | None = None  # raised by the copy; re-raised to whoever waits

    @property
    def items(self) -> int:
        return int(self.dst_idx.numel())

    def finished(self) -> bool:
        return self.landed >= self.items or (self.cancelled and self.next == self.landed)


class RecallScheduler:
    def __init__(self, num_layers: int, chunk_items: int = 64, delay=None, copy_fn=None):
        if chunk_items < 1:
            raise ValueError(f"RecallScheduler: chunk_items must be >= 1, got {chunk_items}")
        self.num_layers, self.chunk_items = num_layers, chunk_items
        self._delay = delay
        self._copy = copy_fn or ops.copy_items
        self._queue: list[Transfer] = []
        self._cv = threading.Condition()
        self._closed = False
        self._current: Transfer | None = None
        self._last: Transfer | None = None  # the transfer of the last chunk taken (preemption counting)
        self._stream = None
        self._demanding = 0  # inline demand copies running (the worker pauses prefetches meanwhile)
        self._preempted: Transfer | None = None
        # failed demand transfers that left the queue before their layer waited: wait() raises them
        self._failed: dict[int, Transfer] = {}
        self.stats = {key: [0.0 if key.endswith("seconds") else 0 for _ in range(num_layers)] for key in
                      ("demand_seconds", "prefetch_seconds", "stall_seconds", "demand_items", "prefetch_items",
                       "dropped_items", "preemptions", "resumed")}
        self.order: list[tuple[str, int, int]] = []  # (kind, layer, first item) of each chunk, for tests
        self.keep_order = False
        self._worker = threading.Thread(target=self._run, name="nosa-recall", daemon=True)
        self._worker.start()

    # ---- called by the block cache -------------------------------------------------------------
    def submit(self, layer: int, kind: str, dst, src, dst_idx: torch.Tensor, src_idx: torch.Tensor) -> Transfer:
        if kind not in (DEMAND, PREFETCH):
            raise ValueError(f"RecallScheduler.submit: kind must be {DEMAND!r} or {PREFETCH!r}, got {kind!r}")
        if dst_idx.shape != src_idx.shape or dst_idx.dim() != 1:
            raise ValueError(f"RecallScheduler.submit: dst_idx {tuple(dst_idx.shape)} and src_idx "
                             f"{tuple(src_idx.shape)} must be equal 1-d index lists")
        job = Transfer(layer, kind, list(dst), list(src), dst_idx, src_idx, self.chunk_items)
        if job.items == 0:
            job.done.set()
            return job
        with self._cv:
            if self._closed:
                raise RuntimeError("RecallScheduler: submit after close()")
            self._queue.append(job)
            self._cv.notify_all()
        return job

    def wait(self, layer: int, jobs: list[Transfer] | None = None) -> float:
        """Block until ``jobs`` (default: every queued demand transfer of ``layer``) are copied;
        returns the seconds spent blocked (the layer's stall)."""
        with self._cv:
            if jobs is None:
                jobs = [j for j in self._queue if j.layer == layer and j.kind == DEMAND]
                if self._current is not None and self._current.layer == layer and self._current.kind == DEMAND \
                        and self._current not in jobs:
                    jobs.append(self._current)
                failed = self._failed.pop(layer, None)
                if failed is not None and failed not in jobs:
                    jobs.append(failed)
        start = time.perf_counter()
        for job in jobs:
            job.done.wait()
            if job.error is not None:
                raise RuntimeError(f"nosa recall: the copy for layer {job.layer} failed") from job.error
            if job.cuda_event is not None:
                torch.cuda.current_stream().wait_event(job.cuda_event)
        stalled = time.perf_counter() - start
        self.stats["stall_seconds"][layer] += stalled
        return stalled

    def demand(self, layer: int, dst, src, dst_idx: torch.Tensor, src_idx: torch.Tensor) -> float:
        """Copy a layer's misses now, in the calling thread, pausing prefetches at their next chunk
        boundary; returns the seconds it took (the layer's stall)."""
        n = int(dst_idx.numel())
        if n == 0:
            return 0.0
        with self._cv:
            self._demanding += 1
            current = self._current
            if current is not None and current.kind == PREFETCH and not current.finished():
                self.stats["preemptions"][current.layer] += 1
                self._preempted = current
            if self.keep_order:
                self.order.append((DEMAND, layer, 0))
        start = time.perf_counter()
        try:
            delay = self._delay(DEMAND, layer) if callable(self._delay) else self._delay
            if delay:
                time.sleep(delay)
            self._copy(list(dst), list(src), dst_idx, src_idx)
        finally:
            with self._cv:
                self._demanding -= 1
                self._cv.notify_all()
        seconds = time.perf_counter() - start
        self.stats["demand_seconds"][layer] += seconds
        self.stats["stall_seconds"][layer] += seconds
        self.stats["demand_items"][layer] += n
        return seconds

    def claim(self, job: Transfer) -> int:
        """The prefetch's layer has come: drop its chunks not started, wait for the one in flight;
        returns how many leading items landed."""
        with self._cv:
            if not job.finished():
                job.cancelled = True
                self.stats["dropped_items"][job.layer] += job.items - job.next
            while not job.finished():
                self._cv.wait()
            if job in self._queue:
                self._queue.remove(job)
            job.done.set()
        if job.error is not None:
            raise RuntimeError(f"nosa recall: the prefetch for layer {job.layer} failed") from job.error
        if job.cuda_event is not None:
            torch.cuda.current_stream().wait_event(job.cuda_event)
        return job.landed

    def idle(self) -> bool:
        with self._cv:
            return not self._queue and self._current is None

    def close(self) -> None:
        with self._cv:
            self._closed = True
            for job in self._queue:
                job.cancelled = True
            self._cv.notify_all()
        self._worker.join(timeout=10)

    # ---- the worker --------------------------------------------------------------------------
    def _pick(self) -> Transfer | None:
        demand = [j for j in self._queue if j.kind == DEMAND and not j.cancelled]
        if demand:
            return demand[0]
        if self._demanding:  # an inline demand copy runs: prefetches wait for it
            return None
        prefetch = [j for j in self._queue if not j.cancelled]
        return prefetch[0] if prefetch else None

    def _run(self) -> None:
        while True:
            with self._cv:
                job = self._pick()
                while job is None and not self._closed:
                    self._cv.wait()
                    job = self._pick()
                if job is None:
                    return
                if job.kind == DEMAND and self._last is not None and self._last.kind == PREFETCH \
                        and not self._last.finished() and self._last.started:
                    self.stats["preemptions"][self._last.layer] += 1
                if job.kind == PREFETCH and job.started and (self._last is not job or self._preempted is job):
                    self.stats["resumed"][job.layer] += 1
                    self._preempted = None
                lo, hi = job.next, min(job.items, job.next + job.chunk)
                job.next, job.started = hi, True
                self._current = self._last = job
                if self.keep_order:
                    self.order.append((job.kind, job.layer, lo))
            try:
                seconds = self._copy_chunk(job, lo, hi)
            except BaseException as exc:  # never leave a waiter hanging: hand the error over
                seconds, job.error, job.cancelled, hi = 0.0, exc, True, lo
                job.next = lo
            with self._cv:
                job.landed = hi
                self._current = None
                self.stats[f"{job.kind}_seconds"][job.layer] += seconds
                self.stats[f"{job.kind}_items"][job.layer] += hi - lo
                if job.finished():
                    if job in self._queue:
                        self._queue.remove(job)
                    if job.error is not None and job.kind == DEMAND:
                        self._failed.setdefault(job.layer, job)
                    job.done.set()
                self._cv.notify_all()

    def _copy_chunk(self, job: Transfer, lo: int, hi: int) -> float:
        delay = self._delay(job.kind, job.layer) if callable(self._delay) else self._delay
        if delay:
            time.sleep(delay)
        start = time.perf_counter()
        on_cuda = any(t.is_cuda for t in job.dst)
        if on_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(device=job.dst[0].device)
            with torch.cuda.stream(self._stream):
                self._copy(job.dst, job.src, job.dst_idx[lo:hi], job.src_idx[lo:hi])
                event = torch.cuda.Event()
                event.record(self._stream)
            job.cuda_event = event
            if job.kind == PREFETCH:
                event.synchronize()  # a demand never queues behind more than one prefetch chunk
        else:
            self._copy(job.dst, job.src, job.dst_idx[lo:hi], job.src_idx[lo:hi])
        return time.perf_counter() - start

