"""The serving extend path without a server (nosa.serve.backend.prefill_from_pool): the context
read from a token-slot pool, its eviction scores from the cis the backend stored with each token."""

from __future__ import annotations

import pytest
import torch

from nosa import EvictionHead, NosaConfig, nosa_prefill
from nosa.serve.backend import prefill_from_pool


@pytest.mark.parametrize("dense_len", [0, 64])
def test_extend_from_the_pool_equals_nosa_prefill_on_the_context(dense_len):
    """A request of 180 tokens written to scattered pool slots in three extends (cis computed per
    extend, as the backend's store does), then its last extend's rows: the cis read back equals the
    cis recomputed over the whole context (up to the matmul's rounding, which depends on how many
    rows it gets), and the output equals nosa_prefill's on the context."""
    cfg = NosaConfig.tiny(dense_len=dense_len)
    hq, hkv, d, length = 4, 2, 16, 180
    g = torch.Generator().manual_seed(0)
    head = EvictionHead(hkv, d)
    with torch.no_grad():
        head.scale.fill_(0.7)
        head.proj.weight.normal_(generator=g)
    k_buf, v_buf, cis_buf = torch.zeros(400, hkv, d), torch.zeros(400, hkv, d), torch.zeros(400, hkv)
    slots = torch.randperm(400, generator=g)[:length]
    k, v = torch.randn(length, hkv, d, generator=g), torch.randn(length, hkv, d, generator=g)
    start = 0
    with torch.no_grad():
        for n in (37, 100, 43):  # extends write their tokens and the tokens' cis
            new, rows = slots[start : start + n], slice(start, start + n)
            k_buf[new], v_buf[new], cis_buf[new] = k[rows], v[rows], head(v[rows])
            start += n
        cis = head(v)
        torch.testing.assert_close(cis_buf[slots], cis, atol=0, rtol=2e-7)  # up to rounding of the matmul
        q = torch.randn(43, hq, d, generator=g)
        out = prefill_from_pool(q, k_buf, v_buf, cis_buf, slots, cfg, 0.3)
        want, _ = nosa_prefill(q, k, v, cis, cfg, 0.3)
    assert cfg.num_blocks(length) > cfg.topk_blocks  # the rows are sparse for real
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
