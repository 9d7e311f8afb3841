"""The seams of a decode step (select -> resolve -> attend) that offloading sits between:
lse-merging of partial attention, entered/left sets, the query-independent part of a selection,
KV views, and the prefill that reads its context only through a view."""

import pytest
import torch

from nosa import EvictionHead, NosaConfig, NosaDecodeState, nosa_prefill
from nosa.attention.math import attend_gathered, merge_attention
from nosa.kv import ContiguousKV, PagedKV
from nosa.layout import NEG_INF
from nosa.select import blocks_entering, selection_change


def _seq(length, hq=4, hkv=2, d=8, seed=0, a=0.8):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(length, h, d, generator=g) for h in (hq, hkv, hkv))
    torch.manual_seed(seed)
    head = EvictionHead(hkv, d)
    with torch.no_grad():
        head.scale.fill_(a)
        cis = head(v)
    return q, k, v, cis


def test_attention_over_disjoint_key_sets_merges_exactly_by_lse():
    g = torch.Generator().manual_seed(0)
    n, hq, hkv, d, t = 3, 4, 2, 8, 40
    q = torch.randn(n, hq, d, generator=g, dtype=torch.float64)
    pool_k = torch.randn(100, d, generator=g, dtype=torch.float64)
    pool_v = torch.randn(100, d, generator=g, dtype=torch.float64)
    rows = torch.randint(0, 100, (n, hkv, t), generator=g)
    bias = torch.randn(n, hkv, t, generator=g, dtype=torch.float64)
    bias[0, 1, 5:9] = NEG_INF  # skipped keys
    whole, lse = attend_gathered(q, pool_k, pool_v, rows, bias, 0.4)
    split = t // 3
    a = attend_gathered(q, pool_k, pool_v, rows[..., :split], bias[..., :split], 0.4)
    b = attend_gathered(q, pool_k, pool_v, rows[..., split:], bias[..., split:], 0.4)
    merged, merged_lse = merge_attention([a[0], b[0]], [a[1], b[1]])
    torch.testing.assert_close(merged, whole, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(merged_lse, lse, rtol=1e-12, atol=1e-12)
    # lse is the log of the softmax normaliser
    logits = torch.einsum("hgd,htd->hgt", q[1].view(hkv, 2, d), pool_k[rows[1]]) * 0.4 + bias[1][:, None]
    torch.testing.assert_close(lse[1], torch.logsumexp(logits, -1).flatten(), rtol=1e-12, atol=1e-12)
    # a part with no key contributes nothing
    none = torch.full((n, hkv, 2), NEG_INF, dtype=torch.float64)
    empty = attend_gathered(q, pool_k, pool_v, rows[..., :2], none, 0.4)
    assert torch.equal(empty[0], torch.zeros_like(empty[0])) and bool((empty[1] == NEG_INF).all())
    merged, _ = merge_attention([whole, empty[0]], [lse, empty[1]])
    torch.testing.assert_close(merged, whole)


def test_selection_change_reports_sets():
    prev = torch.tensor([[0, 3, 5, 9, -1]])
    cur = torch.tensor([[0, 4, 5, 10, 11]])
    entered, left = selection_change(prev, cur)
    assert sorted(x for x in entered[0].tolist() if x >= 0) == [4, 10, 11]
    assert sorted(x for x in left[0].tolist() if x >= 0) == [3, 9]
    assert torch.equal((entered >= 0).sum(-1), blocks_entering(prev, cur))


@pytest.mark.parametrize("a", [0.0, 1.3])
def test_static_part_is_selected_whatever_the_query(a):
    """The query-independent part (forced blocks + static eviction top) is a subset of every
    selection: for 40 decode steps and 5 random queries each. With A = 0 it is the forced blocks."""
    cfg = NosaConfig.tiny(topk_blocks=9, query_blocks=3, window_blocks=2)
    length = 400
    q, k, v, cis = _seq(length, a=a, seed=3)
    state = NosaDecodeState(cfg, 2, 8)
    g = torch.Generator().manual_seed(1)
    for t in range(360, length):
        state.append(ContiguousKV(k[: t + 1], v[: t + 1], cis[: t + 1]))
        static = state.static_blocks()
        for _ in range(5):
            sel = state.select(torch.randn(4, 8, generator=g) * 3, 0.35)
            for h in range(2):
                want = set(static[h][static[h] >= 0].tolist())
                assert want <= set(sel[h].tolist()), (t, h, want - set(sel[h].tolist()))
        cur = t // cfg.block_size
        forced = {0} | set(range(cur - cfg.window_blocks + 1, cur + 1))
        sizes = {int((static[h] >= 0).sum()) for h in range(2)}
        if a == 0.0:
            assert all(set(static[h][static[h] >= 0].tolist()) == forced for h in range(2))
        else:
            assert sizes == {cfg.topk_blocks - cfg.query_blocks}


def test_paged_view_equals_contiguous_view():
    length = 150
    q, k, v, cis = _seq(length, seed=5)
    slots = torch.randperm(length + 20)[:length]
    k_pool, v_pool, c_pool = torch.randn(length + 20, 2, 8), torch.randn(length + 20, 2, 8), torch.randn(length + 20, 2)
    k_pool[slots], v_pool[slots], c_pool[slots] = k, v, cis
    flat, paged = ContiguousKV(k, v, cis), PagedKV(k_pool, v_pool, c_pool, slots[None], torch.tensor([0]), [length])
    blocks = torch.tensor([0, 3, 9])
    for got, want in zip(paged.gather_blocks(0, blocks, 16), flat.gather_blocks(0, blocks, 16)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    sel = torch.tensor([[[0, 4, 9, -1], [1, 2, 8, 9]]])
    a, b = flat.resolve(sel, torch.tensor([length]), 16), paged.resolve(sel, torch.tensor([length]), 16)
    assert torch.equal(a.valid, b.valid)
    torch.testing.assert_close(a.k[a.rows], b.k[b.rows], rtol=0, atol=0)
    torch.testing.assert_close(a.cis[a.rows][a.valid], b.cis[b.rows][b.valid], rtol=0, atol=0)


@pytest.mark.parametrize("plan_pairs", [1 << 19, 64 * 2 * 8], ids=["one-union", "unions-of-64-rows"])
@pytest.mark.parametrize("dense_len", [0, 100])
def test_prefill_through_a_view_equals_nosa_prefill(dense_len, plan_pairs, monkeypatch):
    """Chunked prefill that reads its context only through a KV view (the offloading server's
    extend): selections equal nosa_prefill's and outputs match, chunk by chunk, whether a chunk's
    rows gather one union of blocks or several (``union_rows``: here 64-row groups, aligned to
    absolute positions, so the chunks of 70 and 130 rows straddle groups)."""
    import nosa.decode

    monkeypatch.setattr(nosa.decode, "PLAN_PAIRS", plan_pairs)
    cfg = NosaConfig.tiny(dense_len=dense_len)
    assert nosa.decode.union_rows(cfg, 2, 64) == (64 if plan_pairs < 1 << 19 else (1 << 19) // 16)
    length = 330
    q, k, v, cis = _seq(length, seed=7)
    want_out, want_sel = nosa_prefill(q, k, v, cis, cfg, 0.35)
    state = NosaDecodeState(cfg, 2, 8)
    done = 0
    for stop in (70, 200, 330):  # three chunks of a chunked prefill
        kv = ContiguousKV(k[:stop], v[:stop], cis[:stop])
        out, sel = state.prefill(q[done:stop], kv, 0.35)
        assert torch.equal(sel, want_sel[done:stop]), (done, stop)
        torch.testing.assert_close(out, want_out[done:stop], rtol=1e-5, atol=2e-6)
        done = stop
    assert state.length == length


def test_decode_through_the_kernels_equals_the_torch_path(monkeypatch):
    """On CUDA decode_attend hands the resolved blocks to nosa.ops' kernels (paged token pool
    here; the block cache in tests/serve/test_block_cache.py); under the Triton interpreter they
    give the torch path's outputs and lse."""
    from nosa.decode import decode_attend

    cfg = NosaConfig.tiny(dense_len=0)
    length = 120
    q, k, v, cis = _seq(length, seed=8)
    slots = torch.randperm(length + 10)[:length]
    k_pool, v_pool, c_pool = torch.zeros(length + 10, 2, 8), torch.zeros(length + 10, 2, 8), torch.zeros(length + 10, 2)
    k_pool[slots], v_pool[slots], c_pool[slots] = k, v, cis
    kv = PagedKV(k_pool, v_pool, c_pool, slots[None], torch.tensor([0]), [length])
    results = []
    for kernels in ("reference", "triton"):
        monkeypatch.setenv("NOSA_KERNELS", kernels)
        state = NosaDecodeState(cfg, 2, 8)
        state.append(kv)
        results.append(decode_attend([state], q[-1:], kv, 0.35, return_lse=True))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(results[1][1].float(), results[0][1].float(), rtol=1e-4, atol=1e-5)


def test_prefill_through_a_view_uses_the_kernel_when_asked(monkeypatch):
    """NosaDecodeState.prefill goes through nosa.attention.prefill.attend_selected, so on CUDA (here
    NOSA_KERNELS=triton under the interpreter) the offloading server's prefill runs the Triton
    block-sparse kernel; it gives the torch path's rows."""
    cfg = NosaConfig.tiny(dense_len=0)
    q, k, v, cis = _seq(96, seed=4)
    outs = []
    for kernels in ("reference", "triton"):
        monkeypatch.setenv("NOSA_KERNELS", kernels)
        state = NosaDecodeState(cfg, 2, 8)
        outs.append(state.prefill(q[64:], ContiguousKV(k, v, cis), 0.35)[0])
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-5)


def test_the_views_and_stores_offer_every_member_of_their_protocol():
    """KVView (nosa.kv) and DecodeStore (nosa.decode) are the seams' contracts: each implementation
    here offers every member (serve's OffloadKV is checked with the serving tests' objects)."""
    from nosa.decode import DecodeStore, GrowingStore
    from nosa.kv import KVView
    from nosa.state_pool import StatePool, pages_for

    def members(protocol):
        return {name for name in vars(protocol) if not name.startswith("_")}

    k, cis = torch.zeros(8, 2, 4), torch.zeros(8, 2)
    views = [ContiguousKV(k, k, cis), PagedKV(k, k, cis, torch.arange(8)[None], torch.tensor([0]), [8])]
    cfg = NosaConfig.tiny()
    pool = StatePool(cfg, 1, 3, 2, 4, 64, pages_for(cfg, 64, 3))
    stores = [GrowingStore(2, 4, None), pool.open(1, 0).store]
    assert members(KVView) == {"length", "keys", "cis", "resolve", "gather_blocks"}
    for obj, protocol in [(v, KVView) for v in views] + [(s, DecodeStore) for s in stores]:
        missing = sorted(name for name in members(protocol) if not hasattr(obj, name))
        assert not missing, f"{type(obj).__name__} lacks {missing} of {protocol.__name__}"
