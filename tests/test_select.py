"""Selection against a brute-force oracle written from the rule in nosa.select's docstring."""

import math

import pytest
import torch

from nosa import NosaConfig, block_eviction_scores, query_block_scores, select_blocks
from nosa.compress import compress_windows, pool_to_blocks


def oracle_select(qs, evict, t, cfg):
    """Plain-Python selection for one row and KV head. qs, evict[..., 0/1]: lists over blocks."""
    cur = t // cfg.block_size
    blocks = range(cur + 1)
    if cur + 1 <= cfg.topk_blocks:
        return sorted(blocks)
    forced = {b for b in blocks if b < cfg.sink_blocks or b > cur - cfg.window_blocks}
    cand = [b for b in blocks if b not in forced and math.isfinite(qs[b])]
    picks = sorted(cand, key=lambda b: (-qs[b], b))[: cfg.query_blocks]
    chosen = forced | set(picks)
    rest = [b for b in blocks if b not in chosen]
    live = any(x != 0 and math.isfinite(x) for b in blocks for x in evict[b])
    rest.sort(key=lambda b: (-evict[b][0], -evict[b][1], 0.0 if live else -qs[b], b))
    chosen |= set(rest[: cfg.topk_blocks - len(chosen)])
    return sorted(chosen)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("eviction", ["random", "zero", "repeated"])
def test_select_matches_oracle(seed, eviction):
    torch.manual_seed(seed)
    cfg = NosaConfig.tiny(topk_blocks=6, query_blocks=2, window_blocks=2)
    length, hq, hkv, d = 200, 4, 2, 8
    q, k = torch.randn(length, hq, d), torch.randn(length, hkv, d)
    cis = torch.zeros(length, hkv) if eviction == "zero" else torch.randn(length, hkv)
    if eviction == "repeated":  # repeated text: whole blocks with identical scores (exact ties)
        cis[64:112] = cis[0:48]
        cis[128:144] = cis[32:48]
    nb = cfg.num_blocks(length)
    positions = torch.arange(length)
    qs = query_block_scores(q, compress_windows(k, cfg), positions, nb, cfg, d**-0.5)
    evict = block_eviction_scores(cis, cfg, nb)
    sel = select_blocks(qs, evict[None], positions, cfg)
    assert sel.shape == (length, hkv, cfg.topk_blocks)
    for t in range(0, length, 7):
        for h in range(hkv):
            want = oracle_select(qs[t, h].tolist(), evict[h].tolist(), t, cfg)
            got = [b for b in sel[t, h].tolist() if b >= 0]
            assert got == want, (t, h)


def test_zero_eviction_is_query_aware_topk():
    """With A = 0 the budget beyond sink + window goes to the best query-aware blocks (InfLLM-v2)."""
    torch.manual_seed(0)
    cfg = NosaConfig.tiny(topk_blocks=6, query_blocks=1)
    length, hkv = 160, 1
    qs = torch.rand(1, hkv, cfg.num_blocks(length))
    evict = block_eviction_scores(torch.zeros(length, hkv), cfg)
    sel = select_blocks(qs, evict[None], torch.tensor([length - 1]), cfg)[0, 0].tolist()
    cur = (length - 1) // cfg.block_size
    forced = {0, cur - 1, cur}
    others = sorted((b for b in range(cur + 1) if b not in forced), key=lambda b: -qs[0, 0, b])
    assert set(sel) == forced | set(others[:3])


def test_query_scores_ignore_windows_beyond_the_row():
    """A row's scores must not depend on keys after its position (causality of selection)."""
    torch.manual_seed(1)
    cfg = NosaConfig.tiny()
    q, k = torch.randn(1, 2, 8), torch.randn(120, 1, 8)
    nb = cfg.num_blocks(120)
    pos = torch.tensor([70])
    a = query_block_scores(q, compress_windows(k, cfg), pos, nb, cfg, 1.0)
    k2 = k.clone()
    k2[71:] = torch.randn_like(k2[71:])
    b = query_block_scores(q, compress_windows(k2, cfg), pos, nb, cfg, 1.0)
    torch.testing.assert_close(a, b)
    assert torch.isinf(a[0, 0, 5:]).all()  # blocks past the row have no visible window


def test_pool_to_blocks_takes_max_over_overlapping_windows():
    cfg = NosaConfig.tiny()  # block 16, kernel 8, stride 4: window j covers [4j, 4j+8)
    scores = torch.arange(10.0)  # windows 0..9 cover tokens 0..44
    pooled = pool_to_blocks(scores, 3, cfg)
    # block 0 = tokens 0..15: windows 0..3; block 1: windows 3..7; block 2: windows 7..9
    assert pooled.tolist() == [3.0, 7.0, 9.0]
    tail = pool_to_blocks(scores[6:], 3, cfg, first_window=6)
    assert tail.tolist() == [float("-inf"), 7.0, 9.0]


@pytest.mark.parametrize("live", [True, False])
def test_select_matches_oracle_on_ties_signed_zeros_and_infinities(live):
    """Scores drawn from a handful of values (exact ties everywhere, -0.0 next to 0.0, -inf): the
    integer-key ranking must still equal the plain lexicographic rule."""
    g = torch.Generator().manual_seed(7)
    cfg = NosaConfig.tiny(topk_blocks=7, query_blocks=2, window_blocks=2)
    rows, hkv, nb = 40, 3, 30
    values = torch.tensor([float("-inf"), -1.5, -0.0, 0.0, 0.25, 2.0])
    qs = values[torch.randint(0, len(values), (rows, hkv, nb), generator=g)]
    if live:
        evict = values[torch.randint(0, len(values), (1, hkv, nb, 2), generator=g)]
    else:
        evict = torch.zeros(1, hkv, nb, 2)
        evict[..., -2:, 0] = float("-inf")  # blocks without a complete window yet
    positions = torch.randint(0, nb * cfg.block_size, (rows,), generator=g)
    sel = select_blocks(qs, evict, positions, cfg)
    for r in range(rows):
        t = int(positions[r])
        for h in range(hkv):
            cur = t // cfg.block_size
            ev = [[(x if b <= cur else float("-inf")) for x in evict[0, h, b].tolist()] for b in range(nb)]
            want = oracle_select(qs[r, h].tolist(), ev, t, cfg)
            assert [b for b in sel[r, h].tolist() if b >= 0] == want, (r, h)


@pytest.mark.parametrize("cfg", [NosaConfig(), NosaConfig.tiny(), NosaConfig.tiny(compress_kernel=4, compress_stride=4),
                                 NosaConfig.tiny(compress_kernel=16, compress_stride=8),
                                 NosaConfig.tiny(compress_kernel=16, compress_stride=16)])
def test_pooling_equals_the_overlap_rule(cfg):
    """pool_to_blocks (its sliding-max path, and the scatter path of the offset form decode uses)
    against the rule: a block's score is the max over overlapping windows."""
    g = torch.Generator().manual_seed(1)
    c, s, bsz = cfg.compress_kernel, cfg.compress_stride, cfg.block_size
    for length in (c, 5 * bsz - 1, 7 * bsz + 3):
        windows, nb = cfg.num_compressed(length), cfg.num_blocks(length)
        scores = torch.randn(3, windows, generator=g)
        scores[0, ::3] = float("-inf")
        want = torch.full((3, nb), float("-inf"))
        for b in range(nb):
            over = [j for j in range(windows) if s * j < (b + 1) * bsz and s * j + c > b * bsz]
            if over:
                want[:, b] = scores[:, over].amax(dim=-1)
        assert torch.equal(pool_to_blocks(scores, nb, cfg), want), (cfg, length)
        split = windows // 2
        parts = torch.maximum(pool_to_blocks(scores[:, :split], nb, cfg),
                              pool_to_blocks(scores[:, split:], nb, cfg, first_window=split))
        assert torch.equal(parts, want), (cfg, length)


def test_released_defaults_pin_the_selection():
    """NosaConfig()'s selection on a fixed input, worked out by hand (so the released values, window
    = current block + 16 before it and 15 free picks, cannot drift). 80 blocks, the row in block 79;
    query score = block index; eviction score 1 for even blocks, 0.5 for odd ones, equal means."""
    cfg = NosaConfig()
    nb, t = 80, 79 * 64 + 10
    qs = torch.arange(nb, dtype=torch.float32)[None, None].repeat(1, 2, 1)
    evict = torch.zeros(1, 2, nb, 2)
    evict[0, 0, :, 0] = torch.where(torch.arange(nb) % 2 == 0, 1.0, 0.5)  # KV head 0: A != 0; head 1: A = 0
    sel = select_blocks(qs, evict, torch.tensor([t]), cfg)[0]
    window = list(range(63, 80))  # blocks cur-16 .. cur: 17 blocks
    picks = list(range(48, 63))  # the 15 best query scores outside sink and window
    evicted = list(range(2, 47, 2)) + list(range(1, 16, 2))  # 23 even blocks, then 8 odd ones by index
    assert sel[0].tolist() == sorted([0] + evicted + picks + window)
    assert sel[1].tolist() == [0] + list(range(17, 80))  # A = 0: the rest by query score (InfLLM-v2)
    for h in range(2):
        assert sel[h].tolist() == oracle_select(qs[0, h].tolist(), evict[0, h].tolist(), t, cfg)


@pytest.mark.parametrize("heads", ["live", "dead", "mixed"])
def test_branch_free_selection_is_the_same(heads):
    """select_blocks(..., branch_free=True), the variant a captured decode step runs, picks the same
    blocks with every head live, none (A = 0) and a mix (a head whose eviction scores are all 0)."""
    torch.manual_seed(5)
    cfg = NosaConfig.tiny(topk_blocks=6, query_blocks=2, window_blocks=2)
    length, hq, hkv, d = 220, 4, 2, 8
    q, k = torch.randn(length, hq, d), torch.randn(length, hkv, d)
    cis = torch.randn(length, hkv)
    if heads != "live":
        cis[:, 0] = 0.0
    if heads == "dead":
        cis[:, 1] = 0.0
    cis[96:128] = cis[32:64]  # exact ties
    nb = cfg.num_blocks(length)
    positions = torch.arange(length)
    qs = query_block_scores(q, compress_windows(k, cfg), positions, nb, cfg, d**-0.5)
    evict = block_eviction_scores(cis, cfg, nb)[None]
    assert torch.equal(select_blocks(qs, evict, positions, cfg, branch_free=True),
                       select_blocks(qs, evict, positions, cfg))


def test_the_selection_does_not_depend_on_its_row_chunks(monkeypatch):
    """select_rows scores rows in chunks (a few on CPU, for the cache; one large one on a GPU,
    SELECT_ELEMENTS_CUDA): every chunk size gives the same selection, so a GPU fine-tune and a CPU
    server select the same blocks for the same inputs."""
    from nosa.attention import prefill

    cfg = NosaConfig(block_size=8, compress_kernel=8, compress_stride=4, sink_blocks=1, window_blocks=2,
                     topk_blocks=8, query_blocks=2, dense_len=0)
    g = torch.Generator().manual_seed(4)
    length, hq, hkv, d = 300, 4, 2, 16
    q, k = torch.randn(length, hq, d, generator=g), torch.randn(length, hkv, d, generator=g)
    cis = torch.randn(length, hkv, generator=g)
    sels = []
    for elements in (1, 1 << 12, 1 << 30):  # a chunk of row_chunk rows, a few chunks, one chunk for all
        monkeypatch.setattr(prefill, "SELECT_ELEMENTS", elements)
        sels.append(prefill.prefill_selection(q, k, cis, cfg, d**-0.5, row_chunk=4))
    assert sels[0].shape == (length, hkv, cfg.topk_blocks)
    assert torch.equal(sels[0], sels[1]) and torch.equal(sels[0], sels[2])
