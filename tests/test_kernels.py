"""Triton kernels against their torch references, and the references against the nosa spec.

Without CUDA the kernels run under TRITON_INTERPRET=1 (set by conftest.py before triton is first
imported); with CUDA they run for real and the same tests compare them with the reference."""

import pytest
import torch

from nosa import EvictionHead, NosaConfig, NosaDecodeState
from nosa.kernels.sparse_decode import sparse_decode, sparse_decode_reference
from nosa.kv import ContiguousKV

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def paged_case(lens, hq, hkv, d, cfg, seed=0, a=0.7):
    """Sequences scattered over a shuffled token pool, with their NOSA decode selections."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    slots = torch.randperm(total + 7, generator=g)[:total]  # token slots, shuffled, with holes
    pool_size = total + 7
    k_pool, v_pool = torch.randn(pool_size, hkv, d, generator=g), torch.randn(pool_size, hkv, d, generator=g)
    torch.manual_seed(seed)
    head = EvictionHead(hkv, d)
    with torch.no_grad():
        head.scale.fill_(a)
        cis_pool = head(v_pool)
    table = torch.zeros(len(lens), max(lens), dtype=torch.int32)
    q = torch.randn(len(lens), hq, d, generator=g)
    sels, spec_out, start = [], [], 0
    for b, n in enumerate(lens):
        s = slots[start : start + n]
        start += n
        table[b, :n] = s.int()
        state = NosaDecodeState(cfg, hkv, d)
        kv = ContiguousKV(k_pool[s], v_pool[s], cis_pool[s])
        state.append(kv)
        spec_out.append(state.attend(q[b], kv, d**-0.5))
        sels.append(state.selection)
    args = dict(q=q, k_pool=k_pool, v_pool=v_pool, cis_pool=cis_pool, token_table=table,
                selection=torch.stack(sels).int(), seq_lens=torch.tensor(lens, dtype=torch.int32))
    return args, torch.stack(spec_out)


CASES = [
    ([150, 37, 96], 4, 2, 16, NosaConfig.tiny()),
    ([300, 64], 8, 1, 32, NosaConfig.tiny(topk_blocks=10, query_blocks=4)),
    ([129], 6, 3, 8, NosaConfig.tiny(window_blocks=3)),
]


@pytest.mark.parametrize("lens, hq, hkv, d, cfg", CASES)
def test_reference_is_the_nosa_decode_spec(lens, hq, hkv, d, cfg):
    args, spec = paged_case(lens, hq, hkv, d, cfg)
    ref = sparse_decode_reference(**args, block_size=cfg.block_size, scale=d**-0.5)
    torch.testing.assert_close(ref, spec, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("lens, hq, hkv, d, cfg", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_decode_kernel_matches_reference(lens, hq, hkv, d, cfg, dtype):
    args, _ = paged_case(lens, hq, hkv, d, cfg, seed=1)
    args = {k: (v.to(DEVICE, dtype) if v.is_floating_point() and k != "cis_pool" else v.to(DEVICE))
            for k, v in args.items()}
    ref = sparse_decode_reference(**args, block_size=cfg.block_size, scale=d**-0.5)
    out = sparse_decode(**args, block_size=cfg.block_size, scale=d**-0.5)
    tol = dict(atol=2e-5, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(out.float(), ref.float(), **tol)


def test_sparse_decode_rejects_bad_shapes():
    args, _ = paged_case([40], 4, 2, 8, NosaConfig.tiny())
    args["cis_pool"] = args["cis_pool"][:, :1]
    with pytest.raises(ValueError, match="pools disagree"):
        sparse_decode(**args, block_size=16, scale=0.3)
    args, _ = paged_case([40], 4, 2, 8, NosaConfig.tiny())
    with pytest.raises(ValueError, match="power of two"):
        sparse_decode(**args, block_size=12, scale=0.3)
