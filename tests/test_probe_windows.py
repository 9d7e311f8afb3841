"""scripts/probe_windows.py (nosa.bench.longctx.layouts): the layouts are scored with the selection's own
query-aware score, and the probe shows the tie that 16/16 windows avoid: a needle in the second half
of a block, seen equally by the window that straddles the block boundary and by the
block's own window, is picked one block early with 32/16 windows and found with 16/16."""

import torch

from nosa.bench.longctx.layouts import TOKEN_MAX, layout_scores, probe_layouts, token_max_scores
from nosa.config import NosaConfig

CFG = NosaConfig(block_size=32, compress_kernel=32, compress_stride=16, sink_blocks=1, window_blocks=2,
                 topk_blocks=4, query_blocks=1, dense_len=0)


def _needle_example(length=256, start=104, width=8):
    """One layer, one KV head of two query heads: every key 0 but a needle of ``width`` tokens at
    ``start`` aligned with q; the dense attention of the last row all on the needle."""
    d = 4
    q = torch.zeros(1, 2, d)
    q[0, :, 0] = 1.0
    k = torch.zeros(length, 1, d)
    k[start : start + width, 0, 0] = 4.0
    probs = torch.zeros(2, length)
    probs[:, start : start + width] = 1.0 / width
    return {"block": start // 32, "layers": {"layer": (q, k, torch.zeros_like(k), probs)}}


def test_token_max_is_each_blocks_best_key():
    torch.manual_seed(0)
    q, k = torch.randn(1, 4, 8), torch.randn(100, 2, 8)  # 100 tokens: the last block is partial
    got = token_max_scores(q, k, num_blocks=4, block=32, scale=0.5)
    for h in range(2):
        want = torch.zeros(4)
        for g in range(2):
            logits = (k[:, h] @ q[0, 2 * h + g]) * 0.5
            best = torch.stack([logits[32 * i : 32 * (i + 1)].max() for i in range(4)])
            want += torch.softmax(best, 0)
        torch.testing.assert_close(got[h], want)


def test_straddling_tie_picks_the_lower_block_with_32_16_windows_not_with_16_16():
    ex = _needle_example()
    q, k = ex["layers"]["layer"][:2]
    scores = layout_scores(q, k, CFG, 1.0)[0]
    assert scores[2] == scores[3]  # the window over tokens 80..111 and the one over 96..127 see the same needle
    sums = probe_layouts([ex], CFG, [(32, 16), (16, 16)], {"layer": 1.0})
    assert sums["32/16"]["top1"] == 0.0 and sums["32/16"]["top2"] == sums["32/16"]["weight"] == 2.0
    assert sums["16/16"]["top1"] == 2.0 and sums["16/16"]["best"] == 1.0 == sums[TOKEN_MAX]["best"]
    assert sums["32/16"]["best"] == 0.0 and sums["16/16"]["heads"] == 1.0


def test_a_block_in_the_window_is_not_probed():
    ex = _needle_example(start=232)  # block 7: the current block, forced
    sums = probe_layouts([ex], CFG, [(16, 16)], {"layer": 1.0})
    assert sums["16/16"]["heads"] == 0.0 and sums["16/16"]["weight"] == 0.0
