"""Unit tests of the interruptible layer-wise recall scheduler (nosa.serve.offload.recall) and of
the device block cache's prefetch through it: preemption and resumption, dropped prefetches, a
layer waiting only for its own blocks, and results that do not depend on timing."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from nosa.serve.offload.recall import DEMAND, PREFETCH, RecallScheduler

ITEM = (4, 3)


def _copy(dst, src, dst_idx, src_idx):
    """copy_items in plain torch: item dst_idx[m] of every dst <- src_idx[m] of its src (-1: skip)."""
    keep = src_idx >= 0
    for d, s in zip(dst, src):
        d[dst_idx[keep]] = s[src_idx[keep]]


def _buffers(items=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.zeros(items, *ITEM), torch.randn(items, *ITEM, generator=g)


class Gate:
    """A copy function that blocks the worker until released, to freeze it mid-transfer."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()
        self.blocked_once = False

    def __call__(self, dst, src, dst_idx, src_idx):
        if not self.blocked_once:
            self.blocked_once = True
            self.entered.set()
            assert self.release.wait(10)
        _copy(dst, src, dst_idx, src_idx)


def test_demand_preempts_a_prefetch_at_the_next_chunk_boundary_and_the_prefetch_resumes():
    gate = Gate()
    sched = RecallScheduler(num_layers=2, chunk_items=4, copy_fn=gate)
    sched.keep_order = True
    dst, src = _buffers()
    try:
        pre = sched.submit(1, PREFETCH, [dst], [src], torch.arange(0, 16), torch.arange(0, 16))
        assert gate.entered.wait(10)  # the worker is inside the prefetch's first chunk
        dem = sched.submit(0, DEMAND, [dst], [src], torch.arange(32, 40), torch.arange(32, 40))
        gate.release.set()
        sched.wait(0)
        assert torch.equal(dst[32:40], src[32:40])
        assert pre.done.wait(10) and sched.claim(pre) == 16
        assert torch.equal(dst[:16], src[:16])
        # order: one prefetch chunk, then the demand's two chunks, then the prefetch resumed
        kinds = [k for k, _, _ in sched.order]
        assert kinds[:3] == [PREFETCH, DEMAND, DEMAND], sched.order
        assert kinds == [PREFETCH, DEMAND, DEMAND, PREFETCH, PREFETCH, PREFETCH]
        assert [lo for k, _, lo in sched.order if k == PREFETCH] == [0, 4, 8, 12]
        assert sched.stats["preemptions"][1] == 1 and sched.stats["resumed"][1] == 1
        assert dem.done.is_set()
    finally:
        sched.close()


def test_a_prefetch_whose_layer_came_is_dropped_and_only_its_landed_prefix_counts():
    gate = Gate()
    sched = RecallScheduler(num_layers=2, chunk_items=4, copy_fn=gate)
    dst, src = _buffers()
    try:
        pre = sched.submit(1, PREFETCH, [dst], [src], torch.arange(0, 20), torch.arange(0, 20))
        assert gate.entered.wait(10)
        threading.Timer(0.2, gate.release.set).start()
        landed = sched.claim(pre)  # waits for the chunk in flight, drops the other four
        assert landed == 4
        assert torch.equal(dst[:4], src[:4]) and not dst[4:20].any()
        assert sched.stats["dropped_items"][1] == 16
        assert sched.idle()
    finally:
        sched.close()


def test_a_layer_waits_only_for_its_own_blocks():
    """Layer 0's demand returns while a slow prefetch for layer 1 queued before it is unfinished."""
    release = threading.Event()

    def copy(dst, src, dst_idx, src_idx):
        if int(dst_idx[0]) < 32:  # the prefetch's chunks are slow until released
            assert release.wait(10)
        _copy(dst, src, dst_idx, src_idx)

    sched = RecallScheduler(num_layers=2, chunk_items=4, copy_fn=copy)
    dst, src = _buffers()
    try:
        pre = sched.submit(1, PREFETCH, [dst], [src], torch.arange(0, 8), torch.arange(0, 8))
        sched.submit(0, DEMAND, [dst], [src], torch.arange(40, 44), torch.arange(40, 44))
        # the worker is stuck in the prefetch's first chunk: the demand is next, then layer 0 is free
        threading.Timer(0.3, release.set).start()
        sched.wait(0)
        assert torch.equal(dst[40:44], src[40:44])
        assert not pre.done.is_set() or pre.landed < 8 or release.is_set()
        assert sched.stats["stall_seconds"][0] > 0
        assert sched.claim(pre) in (4, 8)
    finally:
        release.set()
        sched.close()


def test_padding_and_bad_arguments():
    sched = RecallScheduler(num_layers=1, chunk_items=3)
    dst, src = _buffers()
    try:
        idx = torch.tensor([5, -1, 7, 9, -1])
        sched.submit(0, DEMAND, [dst], [src], idx, torch.tensor([1, -1, -1, 3, -1]))
        sched.wait(0)
        assert torch.equal(dst[5], src[1]) and torch.equal(dst[9], src[3])
        assert not dst[7].any()
        # a failing copy reaches the waiting layer as an error, it does not hang it
        sched.submit(0, DEMAND, [dst], [src[:, :2]], idx, torch.tensor([1, -1, -1, 3, -1]))
        with pytest.raises(RuntimeError, match="copy for layer 0 failed"):
            sched.wait(0)
        # also when the failed copy left the queue before the layer came to wait
        sched.submit(0, DEMAND, [dst], [src[:, :2]], idx, torch.tensor([1, -1, -1, 3, -1]))
        while not sched.idle():
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="copy for layer 0 failed"):
            sched.wait(0)
        sched.wait(0)  # raised once: nothing is pending now
        with pytest.raises(ValueError, match="kind must be"):
            sched.submit(0, "soon", [dst], [src], idx, idx)
        with pytest.raises(ValueError, match="equal 1-d index lists"):
            sched.submit(0, DEMAND, [dst], [src], idx, idx[:2])
    finally:
        sched.close()
    with pytest.raises(ValueError, match="chunk_items"):
        RecallScheduler(num_layers=1, chunk_items=0)


# ---- the block cache's prefetch through the scheduler ------------------------------------------
B, HKV, D = 4, 2, 3


def _cache(scheduler=None, groups=2, ns=4, layers=2):
    from nosa.serve.offload.block_cache import DeviceBlockCache

    return DeviceBlockCache(layers, groups, HKV, ns, B, D, D, torch.float32, "cpu", scheduler=scheduler)


def _host(pages=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(pages * HKV, B, D, generator=g), torch.randn(pages * HKV, B, D, generator=g),
            torch.randn(pages * HKV, B, generator=g))


def _run(cache, seed, prefetch: bool, steps=40):
    """Random selections (3 of 12 blocks) for 2 requests over 2 layers, the caches emptied every 8
    steps (as after a request restarts); while layer 0 'computes', layer 1's guess (its true
    selection with one block replaced at random) is prefetched. Returns the resolved K rows and the
    resident block sets of every (step, layer)."""
    rng = random.Random(seed)
    host = [_host(seed=layer) for layer in range(2)]
    wanted = [[torch.tensor([[sorted(rng.sample(range(12), 3)) for _ in range(HKV)] for _ in range(2)])
               for _ in range(2)] for _ in range(steps)]
    outs, resident = [], []
    groups = cache.groups_of([1, 2])
    for step in range(steps):
        if step % 8 == 0:
            cache.release_all()
        lengths = [48, 48]
        for layer in range(2):
            if prefetch and layer + 1 < 2:
                guess = wanted[step][layer + 1].clone()
                guess[..., rng.randrange(3)] = rng.randrange(12)
                cache.prefetch(layer + 1, groups, guess, lengths, guess, host[layer + 1])
            want = wanted[step][layer]
            found = cache.resolve(layer, groups, want, lengths, want, host[layer])  # block b -> host page b
            outs.append(found.k[found.rows.flatten()].clone())
            resident.append(cache.blocks[layer].clone())
    return outs, resident


@pytest.mark.parametrize("seed", [0, 1])
def test_block_cache_results_do_not_depend_on_prefetch_or_timing(seed):
    """Same rows read, the same slot map after every resolve; prefetch only turns demand misses
    into prefetch hits."""
    plain = _cache()
    want, want_resident = _run(plain, seed, prefetch=False)
    rng = random.Random(seed)
    sched = RecallScheduler(num_layers=2, chunk_items=2, delay=lambda kind, layer: rng.random() * 0.002)
    cache = _cache(sched)
    try:
        got, got_resident = _run(cache, seed, prefetch=True)
    finally:
        sched.close()
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b in zip(got_resident, want_resident):
        assert torch.equal(a, b)
    s, p = cache.stats, plain.stats
    for layer in range(2):
        assert s["hits"][layer] + s["misses"][layer] == s["selected"][layer] == p["selected"][layer]
        assert s["hits"][layer] == p["hits"][layer] + s["prefetch_hits"][layer]
        assert s["misses"][layer] == p["misses"][layer] - s["prefetch_hits"][layer]
        assert s["prefetch_hits"][layer] <= s["prefetched"][layer]
    assert s["prefetched"][0] == 0 and s["prefetch_hits"][1] > 0
    assert sched.stats["demand_items"] == s["misses"] and sched.stats["prefetch_items"] == s["prefetched"]


def test_predicted_blocks_hold_the_static_part_and_the_previous_selection():
    """The prefetch guess for a step: by the locality theorem the new token's static part is a subset
    of its real selection; the previous selection is in the guess too; dense requests: every block."""
    from nosa import NosaConfig
    from nosa.decode import NosaDecodeState
    from nosa.serve.offload.kv import predicted_blocks

    cfg = NosaConfig.tiny(dense_len=64)
    g = torch.Generator().manual_seed(3)
    hkv, d, hq = 2, 8, 4
    states, lengths = [], [300, 40]
    for length in lengths:
        s = NosaDecodeState(cfg, hkv, d)
        s.append_tokens(torch.randn(length - 1, hkv, d, generator=g), torch.rand(length - 1, hkv, generator=g))
        s.select(torch.randn(hq, d, generator=g), 0.3)
        states.append(s)
    previous = states[0].selection.clone()
    pred = predicted_blocks(states + [None], lengths + [50], cfg)
    assert pred.shape == (3, hkv, 2 * cfg.topk_blocks) and bool((pred[2] == -1).all())
    long = states[0]
    long.append_tokens(torch.randn(300, hkv, d, generator=g), torch.rand(300, hkv, generator=g))  # token 299
    real = long.select(torch.randn(hq, d, generator=g), 0.3)
    for h in range(hkv):
        guess = set(pred[0, h].tolist()) - {-1}
        static = set(long.static_blocks()[h].tolist()) - {-1}
        assert static and static <= guess and static <= set(real[h].tolist())
        assert set(previous[h].tolist()) - {-1} <= guess
        assert set(pred[1, h].tolist()) - {-1} == {0, 1, 2}  # 40 tokens = 3 blocks of 16, dense


def test_an_inline_demand_pauses_prefetching_at_the_chunk_boundary_and_prefetching_resumes():
    """The block cache's path: a layer copies its own misses in its thread; the worker finishes the
    prefetch chunk it is in, starts no other until the demand is done, then resumes."""
    events, started, release = [], threading.Event(), threading.Event()

    def copy(dst, src, dst_idx, src_idx):
        if int(dst_idx[0]) < 32:  # prefetch chunks; the first one waits until the demand started
            events.append(("prefetch", int(dst_idx[0])))
            if not started.is_set():
                started.set()
                assert release.wait(10)
        else:
            events.append(("demand start", 0))
            release.set()
            time.sleep(0.3)  # the worker is free now: it must not take the next prefetch chunk
            events.append(("demand end", 0))
        _copy(dst, src, dst_idx, src_idx)

    sched = RecallScheduler(num_layers=2, chunk_items=4, copy_fn=copy)
    dst, src = _buffers()
    try:
        pre = sched.submit(1, PREFETCH, [dst], [src], torch.arange(0, 12), torch.arange(0, 12))
        assert started.wait(10)
        stalled = sched.demand(0, [dst], [src], torch.arange(40, 44), torch.arange(40, 44))
        assert stalled >= 0.3 and torch.equal(dst[40:44], src[40:44])
        assert pre.done.wait(10) and sched.claim(pre) == 12 and torch.equal(dst[:12], src[:12])
        assert events == [("prefetch", 0), ("demand start", 0), ("demand end", 0), ("prefetch", 4), ("prefetch", 8)]
        assert sched.stats["preemptions"][1] == 1 and sched.stats["resumed"][1] == 1
        assert sched.stats["demand_items"][0] == 4 and sched.stats["stall_seconds"][0] >= 0.3
    finally:
        release.set()
        sched.close()
