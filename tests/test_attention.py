"""The reference attention against dense SDPA, against a per-row brute force, and decode vs prefill."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from nosa import EvictionHead, NosaConfig, NosaDecodeState, nosa_prefill, nosa_prefill_varlen
from nosa.attention import paired as paired_module
from nosa.attention.gathered import block_pools
from nosa.attention.math import dense_attention
from nosa.attention.paired import attend_pairs
from nosa.attention.prefill import prefill_attention
from nosa.kv import ContiguousKV, PagedKV


def sdpa(q, k, v, scale):
    """Causal dense attention with torch SDPA, token-major [L, H, D] layout."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        is_causal=True, enable_gqa=True, scale=scale,
    )
    return out[0].transpose(0, 1)


def use_gathered_path(monkeypatch):
    """Route nosa.attention.prefill.attend_selected to the gathered path (``attend_grouped``), whose
    grouping knobs these tests vary; by default short contexts take the masked path."""
    monkeypatch.setattr("nosa.attention.masked.MASKED_KEYS_PER_BUDGET_TRAIN", 0.0)
    monkeypatch.setattr("nosa.attention.masked.MASKED_KEYS_PER_BUDGET_INFER", 0.0)


def make(length, hq, hkv, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(length, h, d, generator=g, dtype=dtype) for h in (hq, hkv, hkv)]


def eviction_scores(v, a=0.5, seed=0):
    torch.manual_seed(seed)
    head = EvictionHead(v.shape[1], v.shape[2], dtype=v.dtype)
    with torch.no_grad():
        head.scale.fill_(a)
    return head, head(v)


@pytest.mark.parametrize("hq, hkv", [(4, 2), (4, 4), (8, 1)])
def test_full_budget_and_zero_a_equals_dense_sdpa(hq, hkv):
    length, d = 150, 16
    cfg = NosaConfig.tiny(topk_blocks=cfg_blocks(150))
    q, k, v = make(length, hq, hkv, d)
    cis = torch.zeros(length, hkv)
    out, sel = nosa_prefill(q, k, v, cis, cfg, d**-0.5)
    torch.testing.assert_close(out, sdpa(q, k, v, d**-0.5), atol=2e-6, rtol=1e-5)
    # decode over every step equals the SDPA row too
    state = NosaDecodeState(cfg, hkv, d)
    ref = sdpa(q, k, v, d**-0.5)
    for t in range(length):
        kv = ContiguousKV(k[: t + 1], v[: t + 1], cis[: t + 1])
        state.append(kv)
        torch.testing.assert_close(state.attend(q[t], kv, d**-0.5), ref[t], atol=2e-6, rtol=1e-5)


def cfg_blocks(length, block=16):
    return -(-length // block)


def brute_force_row(q, k, v, cis, blocks, t, cfg, scale):
    """Attention of row t over the tokens of ``blocks`` (per KV head) at or before t, weighted exp(cis)."""
    hq, hkv = q.shape[1], k.shape[1]
    out = torch.empty(hq, v.shape[-1], dtype=torch.float64)
    for h in range(hq):
        kh = h // (hq // hkv)
        toks = [j for b in blocks[kh] for j in range(b * cfg.block_size, (b + 1) * cfg.block_size) if j <= t]
        toks = torch.tensor(toks)
        logits = (k[toks, kh].double() @ q[t, h].double()) * scale + cis[toks, kh].double()
        out[h] = torch.softmax(logits, 0) @ v[toks, kh].double()
    return out


# inference paths: the gathered path (each group's shared blocks, every row's others block by block,
# nosa.attention.paired) with tiles of one pair, planned and computed a few at a time; with tiles
# of a few pairs; with the defaults; the masked path (None)
@pytest.mark.parametrize("tile, plan_pairs, slice_tiles", [(1, 7, 1), (3, 50, 2), (4, 1 << 16, 64), (None, None, None)])
@pytest.mark.parametrize("dense_len", [0, 40])
def test_sparse_prefill_matches_brute_force_over_its_selection(dense_len, tile, plan_pairs, slice_tiles,
                                                               monkeypatch):
    if tile is not None:
        use_gathered_path(monkeypatch)
        monkeypatch.setattr("nosa.attention.paired.TILE", tile)
        monkeypatch.setattr("nosa.attention.paired.PLAN_PAIRS", plan_pairs)
        monkeypatch.setattr("nosa.attention.paired.SLICE_TILES", slice_tiles)
    length, hq, hkv, d = 180, 4, 2, 8
    cfg = NosaConfig.tiny(dense_len=dense_len)
    q, k, v = make(length, hq, hkv, d, seed=3)
    _, cis = eviction_scores(v)
    cis = cis.detach()
    out, sel = nosa_prefill(q, k, v, cis, cfg, d**-0.5, row_chunk=37)
    dense = sdpa(q, k, v, d**-0.5)
    sparse_rows = 0
    for t in range(length):
        if t + 1 <= dense_len:
            torch.testing.assert_close(out[t], dense[t], atol=2e-6, rtol=1e-5)
            continue
        blocks = [[b for b in sel[t, h].tolist() if b >= 0] for h in range(hkv)]
        assert all(len(b) == min(cfg.topk_blocks, t // 16 + 1) for b in blocks)
        ref = brute_force_row(q, k, v, cis, blocks, t, cfg, d**-0.5)
        torch.testing.assert_close(out[t].double(), ref, atol=2e-5, rtol=1e-4)
        sparse_rows += int(t // 16 + 1 > cfg.topk_blocks)
    assert sparse_rows > 50  # the test really exercised a budget below the context


@pytest.mark.parametrize("cfg", [NosaConfig.tiny(), NosaConfig.tiny(dense_len=64, query_blocks=3, topk_blocks=9),
                                 NosaConfig(block_size=8, compress_kernel=8, compress_stride=4, sink_blocks=2,
                                            window_blocks=2, topk_blocks=7, query_blocks=1, dense_len=0)])
def test_decode_equals_prefill_row_for_row(cfg):
    length, hq, hkv, d = 260, 6, 2, 8
    q, k, v = make(length, hq, hkv, d, seed=5)
    _, cis = eviction_scores(v, a=0.8)
    cis = cis.detach()
    out, sel = nosa_prefill(q, k, v, cis, cfg, d**-0.5)
    state = NosaDecodeState(cfg, hkv, d)
    for t in range(length):
        kv = ContiguousKV(k[: t + 1], v[: t + 1], cis[: t + 1])
        state.append(kv)
        o = state.attend(q[t], kv, d**-0.5)
        assert torch.equal(state.selection, sel[t]), t
        torch.testing.assert_close(o, out[t], atol=2e-6, rtol=1e-5)
    assert state.num_windows == cfg.num_compressed(length)


def test_decode_appends_in_chunks_like_one_token_at_a_time():
    cfg = NosaConfig.tiny()
    length, hkv, d = 150, 2, 8
    q, k, v = make(length, 4, hkv, d, seed=9)
    _, cis = eviction_scores(v)
    cis = cis.detach()
    a, b = NosaDecodeState(cfg, hkv, d), NosaDecodeState(cfg, hkv, d)
    for t in range(length):
        a.append_tokens(k[: t + 1], cis[: t + 1])
    b.append_tokens(k[:97], cis[:97])
    b.append_tokens(k, cis)
    kv = ContiguousKV(k, v, cis)
    torch.testing.assert_close(a.attend(q[-1], kv, 0.3), b.attend(q[-1], kv, 0.3))


class _MaxNumel(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def test_decode_memory_is_linear_in_context():
    """No intermediate of a decode step is anywhere near L x L; state grows linearly."""
    cfg = NosaConfig.tiny()
    length, hq, hkv, d = 2048, 4, 2, 8
    q, k, v = make(length, hq, hkv, d, seed=2)
    cis = torch.zeros(length, hkv)
    state = NosaDecodeState(cfg, hkv, d)
    state.append_tokens(k[:-1], cis[:-1])
    kv = ContiguousKV(k, v, cis)
    with _MaxNumel() as probe:
        state.append(kv)
        state.attend(q[-1], kv, 0.3)
    assert probe.max_numel <= 8 * length * hkv  # O(L); L * L would be 4M
    assert probe.max_numel < length * length / 50
    assert state.compressed_keys.shape[1] == cfg.num_compressed(length)


def test_varlen_sequences_are_independent():
    cfg = NosaConfig.tiny()
    hq, hkv, d = 4, 2, 8
    lens = [70, 33, 120]
    seqs = [make(n, hq, hkv, d, seed=i) for i, n in enumerate(lens)]
    q, k, v = (torch.cat([s[i] for s in seqs]) for i in range(3))
    cis = torch.randn(sum(lens), hkv)
    cu = torch.tensor([0, 70, 103, 223])
    out, _ = nosa_prefill_varlen(q, k, v, cis, cu, cfg, d**-0.5)
    for (lo, hi), (qs, ks, vs) in zip(zip(cu[:-1].tolist(), cu[1:].tolist()), seqs):
        alone, _ = nosa_prefill(qs, ks, vs, cis[lo:hi], cfg, d**-0.5)
        torch.testing.assert_close(out[lo:hi], alone)
    with pytest.raises(ValueError, match="cu_seqlens"):
        nosa_prefill_varlen(q, k, v, cis, torch.tensor([0, 50, 40, 223]), cfg, 1.0)


@pytest.mark.parametrize("rest_tokens", [0, 1 << 20, None])  # gathered (two groupings), masked
def test_gradients_reach_q_k_v_and_eviction_head(rest_tokens, monkeypatch):
    if rest_tokens is not None:
        use_gathered_path(monkeypatch)
        monkeypatch.setattr("nosa.attention.gathered.REST_TOKENS", rest_tokens)
    cfg = NosaConfig.tiny()
    length, hq, hkv, d = 130, 4, 2, 8
    q, k, v = (t.double().requires_grad_() for t in make(length, hq, hkv, d, seed=4))
    head, _ = eviction_scores(v.detach())
    head = head.double()
    with torch.no_grad():
        head.scale.fill_(0.3)
    out, _ = nosa_prefill(q, k, v, head(v), cfg, d**-0.5)
    out.square().sum().backward()
    for name, t in [("q", q), ("k", k), ("v", v), ("W", head.proj.weight), ("b", head.proj.bias), ("A", head.scale)]:
        assert t.grad is not None and torch.isfinite(t.grad).all() and t.grad.abs().sum() > 0, name
    # and it is the true gradient (selection is piecewise constant, attention smooth), checked on
    # a config small enough for numerical differentiation, with a budget below the context
    small = NosaConfig(block_size=4, compress_kernel=4, compress_stride=2, sink_blocks=1, window_blocks=2,
                       topk_blocks=4, query_blocks=1, dense_len=0)
    qs, ks, vs = (t.detach().requires_grad_() for t in make(30, 2, 1, 4, seed=8, dtype=torch.float64))
    cis = (torch.randn(30, 1, dtype=torch.float64) * 0.1).requires_grad_()
    _, sel = nosa_prefill(qs, ks, vs, cis, small, 0.3)
    assert (sel[-1] >= 0).sum() == 4 and small.num_blocks(30) == 8
    assert torch.autograd.gradcheck(lambda a, b, c, e: nosa_prefill(a, b, c, e, small, 0.3)[0], (qs, ks, vs, cis))


@pytest.mark.parametrize("dense_len", [0, 200])
def test_decode_on_a_paged_pool_equals_contiguous(dense_len):
    """The serving layout: tokens scattered over a pool, found through a slot table."""
    cfg = NosaConfig.tiny(dense_len=dense_len)
    length, hq, hkv, d = 170, 4, 2, 8
    q, k, v = make(length, hq, hkv, d, seed=11)
    _, cis = eviction_scores(v)
    cis = cis.detach()
    slots = torch.randperm(length + 30)[:length]
    k_pool, v_pool = torch.randn(length + 30, hkv, d), torch.randn(length + 30, hkv, d)
    k_pool[slots], v_pool[slots] = k, v
    flat, paged = NosaDecodeState(cfg, hkv, d), NosaDecodeState(cfg, hkv, d)
    cis_pool = torch.randn(length + 30, hkv)
    cis_pool[slots] = cis
    flat.append_tokens(k[:100], cis[:100])
    paged.append(PagedKV(k_pool, v_pool, cis_pool, slots[None], torch.tensor([0]), [100]))
    for t in range(100, length):
        flat_kv = ContiguousKV(k[: t + 1], v[: t + 1], cis[: t + 1])
        paged_kv = PagedKV(k_pool, v_pool, cis_pool, slots[None], torch.tensor([0]), [t + 1])
        flat.append(flat_kv)
        paged.append(paged_kv)
        want = flat.attend(q[t], flat_kv, 0.3)
        got = paged.attend(q[t], paged_kv, 0.3)
        assert torch.equal(flat.selection, paged.selection)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dense_len", [0, 120])
def test_batched_decode_equals_prefill_of_each_sequence(dense_len):
    """SGLang's decode batch: sequences of different lengths in one pool behind a padded slot table,
    one decode_attend call per step; each row must equal that sequence's own nosa_prefill row (with
    dense_len=120 the batch mixes dense and sparse rows)."""
    from nosa.decode import decode_attend

    cfg = NosaConfig.tiny(dense_len=dense_len, query_blocks=3, topk_blocks=9)
    hq, hkv, d, steps = 6, 2, 8, 24
    starts = [100, 40, 190]  # tokens already in the state before the first batched step
    seqs = [make(n + steps, hq, hkv, d, seed=20 + i) for i, n in enumerate(starts)]
    cis = [eviction_scores(s[2], a=0.7, seed=i)[1].detach() for i, s in enumerate(seqs)]
    want = [nosa_prefill(q, k, v, c, cfg, 0.3) for (q, k, v), c in zip(seqs, cis)]
    total = sum(n + steps for n in starts)
    perm = torch.randperm(total + 50)
    k_pool, v_pool = torch.randn(total + 50, hkv, d), torch.randn(total + 50, hkv, d)
    cis_pool = torch.randn(total + 50, hkv)
    table = torch.zeros(5, 400, dtype=torch.int32)  # rows 4, 1, 2 hold the sequences
    table_rows = torch.tensor([4, 1, 2])
    used = 0
    for row, (q, k, v), c in zip(table_rows.tolist(), seqs, cis):
        slots = perm[used : used + k.shape[0]]
        used += k.shape[0]
        k_pool[slots], v_pool[slots], cis_pool[slots] = k, v, c
        table[row, : k.shape[0]] = slots.int()

    def view(extra):
        return PagedKV(k_pool, v_pool, cis_pool, table, table_rows, [n + extra for n in starts])

    states = [NosaDecodeState(cfg, hkv, d) for _ in seqs]
    for i, state in enumerate(states):
        state.append(view(0), seq=i)
    for step in range(steps):
        kv = view(step + 1)
        for i, state in enumerate(states):
            state.append(kv, seq=i)
        q = torch.stack([s[0][n + step] for s, n in zip(seqs, starts)])
        out = decode_attend(states, q, kv, 0.3)
        for i, (n, (o_ref, sel_ref)) in enumerate(zip(starts, want)):
            assert torch.equal(states[i].selection, sel_ref[n + step]), (i, step)
            torch.testing.assert_close(out[i], o_ref[n + step], atol=2e-6, rtol=1e-5)


def masked_reference(q, k, v, cis, sel, cfg, scale):
    """Plain autograd attention over all L keys with each row's selection as a mask (float64)."""
    length, hkv = k.shape[0], k.shape[1]
    group = q.shape[1] // hkv
    tok_block = torch.arange(length) // cfg.block_size
    allowed = (sel[..., None] == tok_block).any(dim=-2)  # [n, Hkv, L]
    allowed &= torch.arange(length)[None, None, :] <= torch.arange(length)[:, None, None]
    logits = torch.einsum("nhd,lhd->nhl", q, k.repeat_interleave(group, 1)) * scale
    logits = logits + cis.repeat_interleave(group, 1).T[None]
    logits = logits.masked_fill(~allowed.repeat_interleave(group, 1), float("-inf"))
    return torch.einsum("nhl,lhd->nhd", torch.softmax(logits, dim=-1), v.repeat_interleave(group, 1))


@pytest.mark.parametrize("rest_tokens, row_chunk", [(0, 48), (300, 48), (1 << 20, 48), (1 << 20, 16), (1 << 20, 7),
                                                    (None, None)])
def test_selected_attention_gradients_equal_autograd_reference(rest_tokens, row_chunk, monkeypatch):
    """The hand-written backward of the selected-block attention (groups with shared and per-row
    keys, split groups, single rows, chunks across block boundaries), and the masked path's SDPA
    backward (None), give autograd's gradients of the masked float64 reference."""
    if rest_tokens is not None:
        use_gathered_path(monkeypatch)
        monkeypatch.setattr("nosa.attention.gathered.REST_TOKENS", rest_tokens)
    cfg = NosaConfig.tiny(topk_blocks=5, query_blocks=2)
    length, hq, hkv, d = 200, 6, 2, 8
    q, k, v = (t.double().requires_grad_() for t in make(length, hq, hkv, d, seed=12))
    cis = (torch.randn(length, hkv, dtype=torch.float64) * 0.5).requires_grad_()
    out, sel = nosa_prefill(q, k, v, cis, cfg, 0.4, row_chunk=row_chunk)
    ref = masked_reference(q, k, v, cis, sel, cfg, 0.4)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-10)
    weight = torch.randn_like(out)
    got = torch.autograd.grad((out * weight).sum(), (q, k, v, cis))
    want = torch.autograd.grad((ref * weight).sum(), (q, k, v, cis))
    for name, a, b in zip("q k v cis".split(), got, want):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-9, msg=name)
    assert sel.shape[-1] == 5 and cfg.num_blocks(length) == 13  # the budget is below the context


@pytest.mark.parametrize("n", [200, 120, 30])  # a whole prefill, most of the context, its last rows
def test_dense_attention_equals_masked_softmax(n):
    """dense_attention's three routes (causal, causal over zero-padded rows, explicit mask) against
    a float64 softmax over each row's keys up to its position."""
    length, hq, hkv, d = 200, 6, 2, 8
    q, k, v = make(length, hq, hkv, d, seed=11)
    out = dense_attention(q[-n:], k, v, 0.3)
    logits = torch.einsum("nhd,lhd->hnl", q[-n:].double(), k.double().repeat_interleave(hq // hkv, 1)) * 0.3
    rows = torch.arange(length - n, length)
    logits = logits.masked_fill(torch.arange(length)[None, None] > rows[None, :, None], float("-inf"))
    want = torch.einsum("hnl,lhd->nhd", torch.softmax(logits, -1), v.double().repeat_interleave(hq // hkv, 1))
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dense_len, first", [(0, 0), (64, 0), (64, 150), (400, 100)])
def test_prefill_attention_equals_nosa_prefill(dense_len, first):
    """The serving extend's entry (no selections for the rows within dense_len) gives nosa_prefill's
    output, for a whole prefill and for the last rows of a context."""
    cfg = NosaConfig.tiny(dense_len=dense_len)
    q, k, v = make(260, 4, 2, 8, seed=12)
    _, cis = eviction_scores(v)
    cis = cis.detach()
    with torch.no_grad():
        want, _ = nosa_prefill(q[first:], k, v, cis, cfg, 0.3)
        out = prefill_attention(q[first:], k, v, cis, cfg, 0.3)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("a", [0.0, 0.6])  # eviction heads off (no bias) and on
@pytest.mark.parametrize("first", [0, 203])  # every row, or rows from mid-block on
def test_attend_pairs_window_path_equals_pairs_and_brute_force(a, first, monkeypatch):
    """attend_pairs with the window path (the whole blocks before each row's current one, as one
    fused call per query block over a view of the pools) equals the plain pairs and a float64 brute
    force; small tiles, plans and slices so that blocks span several tiles and plans."""
    monkeypatch.setattr("nosa.attention.paired.TILE", 3)
    monkeypatch.setattr("nosa.attention.paired.PLAN_PAIRS", 400)
    monkeypatch.setattr("nosa.attention.paired.SLICE_TILES", 5)
    cfg = NosaConfig(block_size=8, compress_kernel=8, compress_stride=4, sink_blocks=1, window_blocks=4,
                     topk_blocks=9, query_blocks=2, dense_len=0)
    length, hq, hkv, d = 300, 4, 2, 8
    q, k, v = make(length, hq, hkv, d, seed=13)
    _, cis = eviction_scores(v, a=a)
    cis = cis.detach()
    _, sel = nosa_prefill(q, k, v, cis, cfg, 0.3)
    windows = []
    real = paired_module.attend_windows
    monkeypatch.setattr(paired_module, "attend_windows", lambda *args: windows.append(args[2].numel()) or real(*args))
    pools = block_pools(k, v, cis, torch.float32, cfg.block_size)
    positions = torch.arange(first, length)
    out, lse = attend_pairs(q[first:], pools, sel[first:], positions, cfg.block_size, 0.3, cfg.window_blocks)
    assert sum(windows) > 0.8 * (length - first)  # most rows took the window path
    plain, plain_lse = attend_pairs(q[first:], pools, sel[first:], positions, cfg.block_size, 0.3)
    torch.testing.assert_close(out, plain, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, plain_lse, atol=1e-5, rtol=1e-5)
    for t in range(first, length, 7):
        blocks = [[b for b in sel[t, h].tolist() if b >= 0] for h in range(hkv)]
        ref = brute_force_row(q, k, v, cis, blocks, t, cfg, 0.3)
        torch.testing.assert_close(out[t - first].double(), ref, atol=2e-5, rtol=1e-4)
