"""The batched, shape-static decode step of nosa.state_pool against NosaDecodeState (the spec):
the same compressed keys, static keys and selections, bit for bit, step after step; padding rows
change nothing; states in the pool's pages behave like growing ones; the pool's pages come and go
with its sequences."""

from __future__ import annotations

import pytest
import torch

from nosa import EvictionHead, NosaConfig, NosaDecodeState, state_pool
from nosa.decode import decode_select
from nosa.kv import ContiguousKV
from nosa.state_pool import SPARE_PAGE, StatePool, pages_for

HQ, HKV, D = 4, 2, 8
CONFIGS = {
    "tiny": NosaConfig.tiny(topk_blocks=6, query_blocks=2, window_blocks=2, dense_len=0),
    # the released ratios: kernel = 2 x stride, block = 4 x stride, A != 0 on one head only
    "released": NosaConfig(block_size=16, compress_kernel=8, compress_stride=4, sink_blocks=1, window_blocks=3,
                           topk_blocks=8, query_blocks=3, dense_len=0),
    # disjoint windows, two per block (kernel = stride = block / 2: the 16/16 fine-tune's layout)
    "disjoint": NosaConfig(block_size=16, compress_kernel=8, compress_stride=8, sink_blocks=1, window_blocks=2,
                           topk_blocks=7, query_blocks=2, dense_len=0),
}


def _seq(length, seed, a=(0.9, 0.0)):
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(length, HKV, D, generator=g) for _ in range(2))
    torch.manual_seed(seed)
    head = EvictionHead(HKV, D)
    with torch.no_grad():
        head.scale.copy_(torch.tensor(a))
        cis = head(v)
    return k, cis


def _pool(cfg, max_context=400, rows=6, pages=None):
    return StatePool(cfg, 1, rows, HKV, D, max_context, pages or pages_for(cfg, 3 * max_context, rows))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_batched_step_equals_the_state_step_by_step(name):
    """Three sequences (rows 4, 1, 2) caught up through NosaDecodeState over the pool's pages, then 40
    batched steps: every step the same selections as decode_select on growing states, and the
    pool's compressed and static keys equal theirs exactly."""
    cfg = CONFIGS[name]
    starts, rows = [37, 150, 301], [4, 1, 2]
    seqs = [_seq(n + 40, seed=i) for i, n in enumerate(starts)]
    pool = _pool(cfg)
    ref = [NosaDecodeState(cfg, HKV, D) for _ in rows]
    got = [pool.open(r, 0) for r in rows]
    for (k, cis), n, a, b, r in zip(seqs, starts, ref, got, rows):
        a.append(ContiguousKV(k[: n - 1], None, cis[: n - 1]))
        b.append(ContiguousKV(k[: n - 1], None, cis[: n - 1]))
        pool.refill_tails(0, r, ContiguousKV(k, None, cis), 0, n - 1)
    g = torch.Generator().manual_seed(7)
    rows_t = torch.tensor(rows)
    for step in range(40):
        lengths = [n + step for n in starts]
        for (k, cis), n, a in zip(seqs, lengths, ref):
            a.append(ContiguousKV(k[:n], None, cis[:n]))
        q = torch.randn(len(rows), HQ, D, generator=g) * 3
        want = decode_select(ref, q, 0.4)
        for r, n in zip(rows, lengths):
            pool.reserve(r, n)
        lengths_t = torch.tensor(lengths)
        new_k = torch.stack([k[n - 1] for (k, _), n in zip(seqs, lengths)])
        new_cis = torch.stack([cis[n - 1] for (_, cis), n in zip(seqs, lengths)])
        pool.advance(0, rows_t, lengths_t, new_k, new_cis)
        windows, blocks = max(s.num_windows for s in ref), cfg.num_blocks(max(lengths))
        sel = pool.select(0, rows_t, lengths_t, q, 0.4, windows, blocks)
        assert torch.equal(sel, want), step
        assert torch.equal(pool.selection[0][rows_t], want)
        for a, b, n in zip(ref, got, lengths):
            b.advanced(n)
            assert torch.equal(b.compressed_keys, a.compressed_keys), step
            assert torch.equal(b.static_keys, a.static_keys), step


def test_wider_spans_give_the_same_selection(monkeypatch):
    """A captured CUDA graph reads the longest context's spans, a step captured for SGLang's CPU
    graph runner its context bucket's: the result does not depend on them. The bucket is the
    shortest that holds the batch's longest context."""
    cfg = CONFIGS["released"]
    pool = _pool(cfg, max_context=1024)
    k, cis = _seq(200, seed=3)
    state = pool.open(3, 0)
    state.append(ContiguousKV(k[:199], None, cis[:199]))
    pool.refill_tails(0, 3, ContiguousKV(k, None, cis), 0, 199)
    pool.reserve(3, 200)
    rows, lengths = torch.tensor([3]), torch.tensor([200])
    pool.advance(0, rows, lengths, k[199:], cis[199:])
    q = torch.randn(1, HQ, D)
    tight = pool.select(0, rows, lengths, q, 0.3, cfg.num_compressed(200), cfg.num_blocks(200))
    wide = pool.select(0, rows, lengths, q, 0.3, pool.max_windows, pool.max_blocks)
    assert torch.equal(tight, wide)
    # buckets: the pool's longest context halved down to the budget (8 blocks of 16), at most 4
    assert pool.span_limits() == [128, 256, 512, 1024]
    spans = []
    select_pages = state_pool._select_pages
    monkeypatch.setattr(state_pool, "_select_pages", lambda *a: spans.append(a[-2:]) or select_pages(*a))
    assert torch.equal(pool.select(0, rows, lengths, q, 0.3, None, None), tight)
    assert spans == [(cfg.num_compressed(256), cfg.num_blocks(256))]
    monkeypatch.setenv("NOSA_GRAPH_SPAN_BUCKETS", "1")  # one bucket: the longest context's spans
    assert _pool(cfg, max_context=1024).span_limits() == [1024]
    monkeypatch.setenv("NOSA_GRAPH_SPAN_BUCKETS", "0")
    with pytest.raises(ValueError, match="NOSA_GRAPH_SPAN_BUCKETS=0 must be >= 1"):
        _pool(cfg, max_context=1024).span_limits()


def test_padding_rows_change_nothing_but_the_spare_page():
    """Row 0 (SGLang's padding row) in the batch: the real rows' selections and every page but the
    spare one are what they are without it."""
    cfg = CONFIGS["tiny"]
    k, cis = _seq(120, seed=1)
    results = []
    for padded in (False, True):
        pool = _pool(cfg)
        state = pool.open(2, 0)
        state.append(ContiguousKV(k[:99], None, cis[:99]))
        pool.refill_tails(0, 2, ContiguousKV(k, None, cis), 0, 99)
        g = torch.Generator().manual_seed(0)
        sels = []
        for n in range(100, 121):
            pool.reserve(2, n)
            rows, lengths = torch.tensor([2]), torch.tensor([n])
            new_k, new_cis, q = k[n - 1 : n], cis[n - 1 : n], torch.randn(1, HQ, D, generator=g)
            if padded:
                rows, lengths = torch.tensor([2, 0, 0]), torch.tensor([n, 1, 1])
                new_k = torch.cat([new_k, torch.randn(2, HKV, D)])
                new_cis = torch.cat([new_cis, torch.randn(2, HKV)])
                q = torch.cat([q, torch.randn(2, HQ, D)])
            pool.advance(0, rows, lengths, new_k, new_cis)
            sels.append(pool.select(0, rows, lengths, q, 0.4, pool.max_windows, pool.max_blocks)[:1])
        used = [p for p in range(pool.num_pages) if p != SPARE_PAGE]
        stacked = [torch.stack(ts) for ts in (pool.ck, pool.static, pool.tail_k, pool.tail_cis, pool.selection)]
        ck, static, tail_k, tail_cis, selection = stacked
        results.append((torch.stack(sels), ck[:, :, used], static[:, used], tail_k[:, 1:], tail_cis[:, 1:],
                        selection[:, 1:]))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_pages_follow_the_sequences():
    """A row takes pages as its context grows and gives them back when it leaves (after the next
    recycle); a row opened again holds no key; the pool grows when sequences outnumber its pages."""
    cfg = CONFIGS["tiny"]  # blocks of 16
    pool = _pool(cfg, max_context=256, rows=4, pages=6)
    pool.reserve(1, 40)  # 3 blocks
    assert pool.table[1, :3].tolist() == [1, 2, 3] and pool.table[1, 3:].eq(SPARE_PAGE).all()
    k, cis = _seq(40, seed=2)
    state = pool.open(1, 0)
    state.append(ContiguousKV(k, None, cis))
    assert bool((state.static_keys[:, :2, 1] > float("-inf")).all())
    pool.release(1)
    assert pool.table[1].eq(SPARE_PAGE).all()
    pool.reserve(2, 30)  # released pages are not reused before recycle: a forward may still write them
    assert pool.table[2, :2].tolist() == [4, 5]
    pool.recycle()
    pool.reserve(3, 60)  # 4 blocks: 3 recycled pages and one more than the pool had
    assert pool.num_pages > 6 and sorted(pool.table[3, :4].tolist())[:3] == [1, 2, 3]
    again = pool.open(3, 0)
    assert again.num_windows == 0 and again.static_keys.shape[1] == 0
    assert bool((pool.static[0][pool.table[3, :4]] == float("-inf")).all())
    with pytest.raises(ValueError, match="longer than the pool"):
        pool.reserve(3, 257)
