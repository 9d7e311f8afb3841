"""Fused query-aware block scores (nosa.kernels.block_scores) against nosa.select (the spec), and
the selection built on them. Without CUDA the kernel runs under TRITON_INTERPRET=1 (conftest.py)."""

import pytest
import torch

from nosa import NosaConfig, ops
from nosa.compress import compress_windows
from nosa.eviction import block_eviction_scores
from nosa.kernels.block_scores import query_block_scores_triton
from nosa.select import query_block_scores, select_blocks

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [  # cfg, context length, rows (the last ones), hq, hkv, head dim
    (NosaConfig.tiny(), 150, 10, 4, 2, 16),
    (NosaConfig(), 700, 4, 8, 2, 32),  # the released window/stride/block sizes
    (NosaConfig.tiny(compress_kernel=16, compress_stride=8), 90, 8, 6, 3, 8),
]


@pytest.mark.parametrize("cfg, length, n, hq, hkv, d", CASES)
def test_block_scores_kernel_matches_select(cfg, length, n, hq, hkv, d):
    g = torch.Generator().manual_seed(length)
    q, k = torch.randn(n, hq, d, generator=g), torch.randn(length, hkv, d, generator=g)
    cis = torch.randn(length, hkv, generator=g)
    compressed = compress_windows(k, cfg)
    positions = torch.arange(length - n, length)
    positions[0] = cfg.compress_kernel - 2  # a row that sees no complete window: every block -inf
    nb = cfg.num_blocks(length)
    want = query_block_scores(q, compressed, positions, nb, cfg, d**-0.5)
    got = query_block_scores_triton(q.to(DEVICE), compressed.to(DEVICE), positions.to(DEVICE), nb, cfg,
                                    d**-0.5).cpu()
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite) and not finite[0].any() and finite[1:].any()
    torch.testing.assert_close(got[finite], want[finite], atol=1e-6, rtol=1e-5)
    # the selection on top of them is the same
    evict = block_eviction_scores(cis, cfg, nb)[None]
    assert torch.equal(select_blocks(got, evict, positions, cfg), select_blocks(want, evict, positions, cfg))


def test_ops_query_block_scores_dispatch(monkeypatch):
    cfg = NosaConfig.tiny()
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 4, 16, generator=g), torch.randn(80, 2, 16, generator=g)
    compressed, positions = compress_windows(k, cfg), torch.tensor([40, 63, 79])
    monkeypatch.setenv("NOSA_KERNELS", "reference")
    want = ops.query_block_scores(q, compressed, positions, 5, cfg, 0.25)
    monkeypatch.setenv("NOSA_KERNELS", "triton")
    got = ops.query_block_scores(q.to(DEVICE), compressed.to(DEVICE), positions.to(DEVICE), 5, cfg, 0.25).cpu()
    finite = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), finite)
    torch.testing.assert_close(got[finite], want[finite], atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="positions"):
        query_block_scores_triton(q, compressed, positions[:2], 5, cfg, 0.25)
