"""The fused CPU resolve kernel (nosa.kernels.resolve_cpu) against its spec, the torch code of
DeviceBlockCache.resolve_layer: two caches fed the same random decode steps, one through each, must
end every step with the same slot maps, device buffers, counters and rows."""

from __future__ import annotations

import random

import pytest
import torch

from nosa.kernels import resolve_cpu
from nosa.serve.offload.block_cache import DeviceBlockCache
from nosa.serve.offload.recall import RecallScheduler
from nosa.serve.offload.resolve import NewTokens, PageTable

B, HKV, D, PAGES = 4, 2, 3, 200

pytestmark = pytest.mark.skipif(resolve_cpu.library() is None, reason="no C++ compiler: the kernel cannot build")


def _pair(groups, ns, home, dtype, scheduler):
    made = []
    for _ in range(2):
        sched = RecallScheduler(num_layers=1, chunk_items=4) if scheduler else None
        made.append(DeviceBlockCache(1, groups, HKV, ns, B, D, D, dtype, "cpu", scheduler=sched, home_slots=home))
    return made


def _host(dtype):
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(PAGES * HKV, B, D, generator=g).to(dtype) for _ in range(2))
    return k, v, torch.randn(PAGES * HKV, B, generator=g)


def _same_rows(a, b):
    assert torch.equal(a.valid, b.valid)
    assert torch.equal(torch.where(a.valid, a.rows, 0), torch.where(b.valid, b.rows, 0))
    assert torch.equal(a.slots, b.slots) and torch.equal(a.fill.int(), b.fill.int())
    # the keys each reads
    assert torch.equal(a.k[a.rows[a.valid]], b.k[b.rows[b.valid]])
    assert torch.equal(a.cis[a.rows[a.valid]], b.cis[b.rows[b.valid]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("admission,scheduler", [(False, False), (True, False), (False, True)])
def test_kernel_equals_the_torch_resolve(monkeypatch, dtype, admission, scheduler):
    """3 requests (one sometimes a padding row in the spare group), 40 decode steps each of random
    selections (hits, misses, -1 padding, the tail block), steps that skip tokens (stale blocks),
    warm and cold rows; with admission, extra slots granted to some groups and none to others; host
    pages given, or looked up in a req_to_token table, every other step."""
    rng = random.Random(0)
    groups, ns, w = 3, 6, 5
    home = 4 if admission else ns
    spec, fused = _pair(groups, ns, home, dtype, scheduler)
    host = _host(dtype)
    if admission:
        for cache in (spec, fused):
            cache.activate(1)
            cache.activate(2)
            assert cache.set_extra({0: 2, 1: 1}) == {0: 2, 1: 1}  # group 2 idle: its columns are lent
    lengths = [40, 53, 61]
    pages = torch.tensor([rng.sample(range(PAGES), 64) for _ in range(groups)])  # block -> host page
    # SGLang's req_to_token of the same layout (row 0: the padding row), which the kernel reads itself
    tokens = torch.arange(64 * B)
    req_to_token = torch.cat([torch.zeros(1, 64 * B, dtype=torch.long), pages[:, tokens // B] * B + tokens % B]).int()
    for step in range(40):
        rows = [1, 2, 0] if step % 5 == 4 else [1, 2, 3]  # 0: a padding row
        for i in range(groups):
            lengths[i] += 1 + (3 if rng.random() < 0.1 else 0)  # now and then a skip (stale tail)
        lens = [lengths[r - 1] if r else 1 for r in rows]
        limit = [home + (2 if i == 0 else 1 if i == 1 else 0) if admission else ns for i in range(groups)]
        wanted = torch.full((groups, HKV, w), -1, dtype=torch.long)
        for i, r in enumerate(rows):
            if not r:
                continue
            nb = -(-lens[i] // B)
            for h in range(HKV):
                picks = {nb - 1} | set(rng.sample(range(nb), min(nb, rng.randint(0, min(w, limit[i]) - 1))))
                picks = sorted(picks)[: min(w, limit[i])]
                rng.shuffle(picks)
                wanted[i, h, : len(picks)] = torch.tensor(picks)
        table = torch.tensor([max(r, 1) - 1 for r in rows])
        page_of = pages[table][:, None, :].expand(-1, HKV, -1)
        page = torch.where(wanted >= 0, page_of.gather(-1, wanted.clamp(min=0)), -1)
        new = NewTokens(torch.randn(groups, HKV, D), torch.randn(groups, HKV, D), torch.randn(groups, HKV))
        real = torch.tensor([bool(r) for r in rows])
        warm = torch.tensor([rng.random() < 0.7 for _ in rows])
        out = []
        for cache, kernels in ((spec, "reference"), (fused, "auto")):
            monkeypatch.setenv("NOSA_KERNELS", kernels)
            grp = cache.groups_of(rows)
            # the host side of a step: stale blocks dropped, groups synced (as begin_decode)
            cache.begin_decode([g for g, r in zip(grp.tolist(), rows) if r], [n for n, r in zip(lens, rows) if r])
            where = page if step % 2 else PageTable(req_to_token, torch.tensor(rows))  # pages given, or looked up
            found = cache.resolve_layer(0, grp, wanted, torch.tensor(lens), where, host, new, warm, real)
            out.append(found)
        _same_rows(*out)
        assert torch.equal(spec.blocks[0], fused.blocks[0]), step
        for a, b in ((spec.k[0], fused.k[0]), (spec.v[0], fused.v[0]), (spec.cis[0], fused.cis[0])):
            assert torch.equal(a, b), step
        assert torch.equal(spec.counts, fused.counts)
        assert torch.equal(spec.max_warm_misses, fused.max_warm_misses)
        assert torch.equal(spec.group_misses, fused.group_misses)
        if scheduler:  # may_prefetch's shortcut (groups the kernel found full) agrees with the slot maps
            for cache in (spec, fused):
                g = cache.groups_of([r for r in rows if r])
                usable = (cache.col_of.index_select(0, g) >= 0)[:, None]
                empty = ((cache.blocks[0].index_select(0, g) < 0) & usable).any()
                assert cache.may_prefetch(0, g, [n for n, r in zip(lens, rows) if r]) == bool(empty), step
    stats = fused.stats
    assert stats["misses"][0] > 0 and stats["hits"][0] > 0 and stats["max_warm_misses"][0] > 0  # both exercised
    if scheduler:
        assert fused.scheduler.stats["demand_items"][0] == spec.scheduler.stats["demand_items"][0] > 0


def test_kernel_refuses_what_it_cannot_index():
    cache = DeviceBlockCache(1, 1, HKV, 2, B, D, D, torch.float32, "cpu")
    host = _host(torch.float32)
    wanted = torch.zeros(1, HKV, 3, dtype=torch.long)  # 3 wanted blocks, 2 slots
    with pytest.raises(ValueError, match="3 wanted blocks per KV head but 2 slots"):
        resolve_cpu.resolve_layer(cache.blocks[0], cache.col_of, torch.tensor([0]), wanted, wanted, torch.tensor([9]),
                                  torch.tensor([True]), None, [cache.k[0], cache.v[0], cache.cis[0]], list(host), None,
                                  cache.dump_row, cache.counts[0], cache.max_warm_misses[0], cache.group_misses, 2)
    with pytest.raises(ValueError, match="differ in number, dtype or item shape"):
        resolve_cpu.resolve_layer(cache.blocks[0], cache.col_of, torch.tensor([0]), wanted[..., :2], wanted[..., :2],
                                  torch.tensor([9]), torch.tensor([True]), None, [cache.k[0], cache.v[0], cache.cis[0]],
                                  [host[0].double(), host[1], host[2]], None, cache.dump_row, cache.counts[0],
                                  cache.max_warm_misses[0], cache.group_misses, 2)


def test_build_reports_a_missing_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("NOSA_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises((RuntimeError, OSError)):
        resolve_cpu.build()
    monkeypatch.delenv("CXX")
    path = resolve_cpu.build()  # the real compiler: into the given cache, named by the source's hash
    assert path.parent == tmp_path and path.exists() and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_kernel_refuses_indices_outside_the_buffers():
    """An index past a buffer raises before anything is copied (the torch path raises on it too):
    no write outside the buffers."""
    host = _host(torch.float32)
    dev = [torch.zeros(4, B, D), torch.zeros(4, B, D), torch.zeros(4, B)]
    with pytest.raises(ValueError, match="outside the 4 dst"):
        resolve_cpu.copy_items(dev, list(host), torch.tensor([1, 4]), torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="outside"):
        resolve_cpu.copy_items(dev, list(host), torch.tensor([1, 2]), torch.tensor([0, PAGES * HKV]))
    assert all(int(t.count_nonzero()) == 0 for t in dev)  # nothing copied
    resolve_cpu.copy_items(dev, list(host), torch.tensor([-1, 2]), torch.tensor([-1, 3]))  # -1: padding
    assert torch.equal(dev[0][2], host[0][3]) and int(dev[0][:2].count_nonzero()) == 0
    # a miss that can only take a slot without a column (every column revoked) has no device item
    cache = DeviceBlockCache(1, 1, HKV, 2, B, D, D, torch.float32, "cpu")
    cache.col_of[0] = -1
    wanted = torch.tensor([[[0, 1], [0, 1]]])
    with pytest.raises(RuntimeError, match="outside the"):
        cache.resolve_layer(0, torch.tensor([0]), wanted, torch.tensor([8]), wanted + 3, host, None,
                            torch.tensor([True]))
    assert int(cache.k[0].count_nonzero()) == 0
