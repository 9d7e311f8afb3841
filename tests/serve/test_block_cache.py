"""Unit tests of the offloading engine without a server: the host pool's layout, the device block
cache's slot diff, its one batched recall and the write-through of new tokens, and the release
of a request's slots."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("sglang")

from nosa.serve.offload.block_cache import DeviceBlockCache  # noqa: E402
from nosa.serve.offload.host_pool import HostKVPool  # noqa: E402
from nosa.serve.offload.resolve import NewTokens  # noqa: E402
from nosa.serve.offload.settings import OffloadSettings  # noqa: E402

B, HKV, D = 4, 2, 3


def _pool(tokens=256, layers=1):
    return HostKVPool(size=tokens, page_size=B, dtype=torch.float32, head_num=HKV, head_dim=D, layer_num=layers,
                      device="cpu", enable_memory_saver=False)


def test_host_pool_keeps_one_block_and_head_contiguous():
    pool = _pool()
    loc = torch.tensor([5, 6, 13, 40])
    k = torch.randn(4, HKV, D)
    v = torch.randn(4, HKV, D)
    cis = torch.randn(4, HKV)

    class Layer:
        layer_id = 0

    pool.set_kv_buffer(Layer(), loc, k, v)
    pool.set_cis(0, loc, cis)
    for i, s in enumerate(loc.tolist()):
        for h in range(HKV):
            assert torch.equal(pool.k_buffer[0][s // B, h, s % B], k[i, h])
            assert torch.equal(pool.v_buffer[0][s // B, h, s % B], v[i, h])
            assert pool.cis_buffer[0][s // B, h, s % B] == cis[i, h]
    # the same loc tensor written again after an in-place change (a graph runner's static buffer):
    # the rows it caches per forward are recomputed
    loc[0] = 77
    pool.set_kv_buffer(Layer(), loc, k, v)
    assert torch.equal(pool.k_buffer[0][77 // B, 1, 77 % B], k[0, 1])
    k_items, _, cis_items = pool.items(0)
    assert pool.items(0)[0] is k_items  # the item views are made once
    # item page * Hkv + h is the contiguous [B, D] block of that head
    assert torch.equal(k_items[(5 // B) * HKV + 1, 5 % B], k[0, 1])
    assert k_items[3].is_contiguous() and k_items.shape == (pool.num_pages * HKV, B, D)
    assert cis_items.shape == (pool.num_pages * HKV, B)


def _cache(groups=2, ns=3, layers=1):
    return DeviceBlockCache(layers, groups, HKV, ns, B, D, D, torch.float32, "cpu")


def _host(pages=40):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(pages * HKV, B, D, generator=g), torch.randn(pages * HKV, B, D, generator=g),
            torch.randn(pages * HKV, B, generator=g))


def test_slot_diff_keeps_hits_and_fills_freed_slots_like_a_plain_model():
    """Random selections over 60 steps for 2 requests: resident blocks never move, misses take free
    slots, the slot contents always equal the host items of their blocks (one recall per step),
    and the counters add up."""
    rng = random.Random(0)
    cache, host = _cache(groups=2, ns=3), _host()
    page_of = {r: {b: rng.randrange(40) for b in range(12)} for r in (1, 2)}
    model = {(r, h): [-1, -1, -1] for r in (1, 2) for h in range(HKV)}  # slot -> block, plain Python
    selected = hits = 0
    for step in range(60):
        wanted = torch.full((2, HKV, 3), -1, dtype=torch.long)
        for i in range(2):
            for h in range(HKV):
                picks = sorted(rng.sample(range(12), rng.randint(1, 3)))
                wanted[i, h, : len(picks)] = torch.tensor(picks)
        pages = torch.where(wanted >= 0, torch.tensor([[[page_of[r][max(b, 0)] for b in wanted[i, h].tolist()]
                                                        for h in range(HKV)] for i, r in enumerate((1, 2))]), -1)
        found = cache.resolve(0, cache.groups_of([1, 2]), wanted, [48, 48], pages, host)
        for i, r in enumerate((1, 2)):
            for h in range(HKV):
                want = [b for b in wanted[i, h].tolist() if b >= 0]
                slots = model[(r, h)]
                hits += sum(b in slots for b in want)
                selected += len(want)
                for s, b in enumerate(slots):  # plain model: free the slots no longer wanted ...
                    if b not in want:
                        slots[s] = None if b == -1 else ("stale", b)
                for b in want:  # ... misses fill empty slots first, then stale ones, in slot order
                    if b not in slots:
                        free = [s for s, x in enumerate(slots) if x is None] + \
                               [s for s, x in enumerate(slots) if isinstance(x, tuple)]
                        slots[free[0]] = b
                model[(r, h)] = [x if isinstance(x, int) else (-1 if x is None else x[1]) for x in slots]
                assert cache.blocks[0][r - 1, h].tolist() == model[(r, h)], (step, r, h)
                for s, b in enumerate(model[(r, h)]):
                    if b in want:  # resident wanted blocks hold exactly their host item
                        item = ((r - 1) * HKV + h) * 3 + s
                        src = page_of[r][b] * HKV + h
                        assert torch.equal(cache.k[0][item], host[0][src])
                        assert torch.equal(cache.cis[0][item], host[2][src])
        # the rows attention reads are those items' tokens, in the wanted order
        for i, r in enumerate((1, 2)):
            for h in range(HKV):
                want = [b for b in wanted[i, h].tolist() if b >= 0]
                expect = torch.cat([host[0][page_of[r][b] * HKV + h] for b in want])[: int(found.valid[i, h].sum())]
                assert torch.equal(found.k[found.rows[i, h][found.valid[i, h]]], expect), (step, r, h)
    stats = cache.stats
    assert stats["selected"][0] == selected and stats["hits"][0] == hits
    assert stats["hits"][0] + stats["misses"][0] == stats["selected"][0]
    assert stats["recalled_bytes"][0] == stats["misses"][0] * cache.item_bytes
    cache.release(1)
    assert int((cache.blocks[0][0] >= 0).sum()) == 0 and int((cache.blocks[0][1] >= 0).sum()) > 0
    cache.release_all()
    assert cache.resident_slots() == 0


def test_new_token_is_written_through_into_the_resident_tail_block():
    cache, host = _cache(groups=1, ns=2), _host()
    wanted = torch.tensor([[[0, 1], [0, 1]]])
    pages = torch.tensor([[[7, 9], [7, 9]]])
    cache.resolve(0, cache.groups_of([1]), wanted, [6], pages, host)  # cold: both blocks recalled
    k_new, v_new, c_new = torch.randn(1, HKV, D), torch.randn(1, HKV, D), torch.randn(1, HKV)
    found = cache.resolve(0, cache.groups_of([1]), wanted, [7], pages, host, new_tokens=NewTokens(k_new, v_new, c_new))
    assert cache.stats["misses"][0] == 4 and cache.stats["hits"][0] == 4  # the tail block was a hit
    for h in range(HKV):
        slot = h * 2 + cache.blocks[0][0, h].tolist().index(1)
        assert torch.equal(cache.k[0][slot, 6 % B], k_new[0, h]) and cache.cis[0][slot, 6 % B] == c_new[0, h]
    assert found.valid.sum() == HKV * 7  # tokens 0..6 of the two blocks
    # a step that skipped tokens (a prefill chunk went to the host only) drops the stale tail block
    # length 7 -> 9: token 7 went to the host pool only (as a prefill chunk's tokens do)
    cache.resolve(0, cache.groups_of([1]), wanted, [9], pages, host, new_tokens=NewTokens(k_new, v_new, c_new))
    assert cache.stats["misses"][0] == 4 + HKV  # block 1 recalled again (its token 7 skipped the cache), block 0 a hit


def test_settings_reject_what_cannot_work():
    from nosa import NosaConfig

    cfg = NosaConfig.tiny(dense_len=64)  # budget 8 blocks of 16
    ok = OffloadSettings(host_tokens=4096, device_tokens=256)
    ok.validate(cfg, page_size=16)
    assert ok.max_requests(cfg) == 2
    with pytest.raises(ValueError, match="--page-size"):
        ok.validate(cfg, page_size=1)
    with pytest.raises(ValueError, match="NOSA_DEVICE_KV_TOKENS"):
        OffloadSettings(host_tokens=4096, device_tokens=100).validate(cfg, page_size=16)
    with pytest.raises(ValueError, match="dense_len"):
        ok.validate(NosaConfig.tiny(dense_len=1000), page_size=16)


def test_resolved_slots_give_the_kernel_the_same_attention_as_the_rows(monkeypatch):
    """The (items, slots, fill) form of a resolve, which nosa.ops.slot_decode reads on CUDA, is the
    same set of keys as its rows: equal attention (reference and the Triton kernel, interpreted)."""
    from nosa import ops
    from nosa.attention.math import attend_gathered
    from nosa.layout import NEG_INF

    cache, host = _cache(groups=2, ns=3), _host()
    wanted = torch.tensor([[[0, 2, 1], [2, -1, 0]], [[3, 1, -1], [0, 1, 3]]])
    pages = torch.where(wanted >= 0, wanted + 5, -1)
    found = cache.resolve(0, cache.groups_of([1, 2]), wanted, [11, 14], pages, host)
    q = torch.randn(2, 4, D)
    bias = torch.where(found.valid, found.cis[found.rows], NEG_INF)
    want = attend_gathered(q, found.k, found.v, found.rows, bias, 0.5)
    for kernels in ("reference", "triton"):
        monkeypatch.setenv("NOSA_KERNELS", kernels)
        got = ops.slot_decode(q, *found.items, found.slots, found.fill, 0.5)
        torch.testing.assert_close(got[0], want[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[1], want[1].float(), rtol=1e-4, atol=1e-5)
