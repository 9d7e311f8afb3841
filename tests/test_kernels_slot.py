"""Decode over the device block cache (nosa.kernels.slot_decode): reference against the paged decode
spec, Triton kernel (split-K and single pass) against the reference, lse merging, bad input.

Without CUDA the kernel runs under TRITON_INTERPRET=1 (conftest.py)."""

import pytest
import torch

from nosa.attention.math import merge_attention
from nosa.kernels.slot_decode import slot_decode, slot_decode_reference
from nosa.kernels.sparse_decode import sparse_decode_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 3e-3}  # ||out - ref|| / ||ref||


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def slot_case(rows, hq, hkv, d, block, ns, dtype, seed=0, unused=1):
    """A device cache of shuffled slots; each (request, KV head) has ns slots, the last one a partial
    tail block, some unused (-1) or empty (fill 0)."""
    g = torch.Generator().manual_seed(seed)
    total = rows * hkv * ns
    cache = total + 5
    k = torch.randn(cache, block, d, generator=g)
    v = torch.randn(cache, block, d, generator=g)
    cis = torch.randn(cache, block, generator=g) * 0.7
    slots = torch.randperm(cache, generator=g)[:total].view(rows, hkv, ns)
    fill = torch.full((rows, hkv, ns), block, dtype=torch.int32)
    fill[..., -1] = torch.randint(1, block + 1, (rows, hkv), generator=g, dtype=torch.int32)
    flat = slots.view(-1)
    flat[torch.randperm(total, generator=g)[:unused]] = -1
    fill.view(-1)[torch.randperm(total, generator=g)[:unused]] = 0
    q = torch.randn(rows, hq, d, generator=g)
    tensors = dict(q=q.to(dtype), k_dev=k.to(dtype), v_dev=v.to(dtype), cis_dev=cis, slots=slots, fill=fill)
    return {name: t.to(DEVICE) for name, t in tensors.items()}


def test_reference_is_the_paged_decode_spec():
    """Blocks copied into slots give exactly the paged spec's attention over the selected blocks."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, block, topk = 6, 3, 8, 16, 5
    lens = [150, 37, 96]
    pool = sum(lens)
    k_pool, v_pool = torch.randn(pool, hkv, d, generator=g), torch.randn(pool, hkv, d, generator=g)
    cis_pool = torch.randn(pool, hkv, generator=g)
    table = torch.zeros(len(lens), max(lens), dtype=torch.int32)
    perm, start = torch.randperm(pool, generator=g), 0
    sel = torch.full((len(lens), hkv, topk), -1, dtype=torch.int32)
    for b, n in enumerate(lens):
        table[b, :n] = perm[start : start + n].int()
        start += n
        blocks = -(-n // block)
        for h in range(hkv):
            chosen = torch.randperm(blocks, generator=g)[:topk]
            sel[b, h, : len(chosen)] = chosen.int()
    q = torch.randn(len(lens), hq, d, generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    want, want_lse = sparse_decode_reference(q, k_pool, v_pool, cis_pool, table, sel, seq_lens, block, d**-0.5,
                                             return_lse=True)
    # the device cache: item (b, h, i) holds block sel[b, h, i] of KV head h, in shuffled slots
    num = len(lens) * hkv * topk
    k_dev, v_dev, c_dev = torch.zeros(num, block, d), torch.zeros(num, block, d), torch.zeros(num, block)
    slots = torch.randperm(num, generator=g).view(len(lens), hkv, topk)
    fill = torch.zeros(len(lens), hkv, topk, dtype=torch.int32)
    for b, n in enumerate(lens):
        for h in range(hkv):
            for i in range(topk):
                blk = int(sel[b, h, i])
                if blk < 0:
                    slots[b, h, i] = -1
                    continue
                tokens = table[b, blk * block : min(n, (blk + 1) * block)].long()
                s = slots[b, h, i]
                fill[b, h, i] = len(tokens)
                k_dev[s, : len(tokens)], v_dev[s, : len(tokens)] = k_pool[tokens, h], v_pool[tokens, h]
                c_dev[s, : len(tokens)] = cis_pool[tokens, h]
    out, lse = slot_decode_reference(q, k_dev, v_dev, c_dev, slots, fill, d**-0.5)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=2e-6, rtol=1e-5)


CASES = [  # rows, hq, hkv, d, block, ns, splits
    (3, 8, 2, 16, 16, 7, 1),
    (3, 8, 2, 16, 16, 7, 3),
    (2, 6, 3, 8, 8, 9, None),
    (1, 4, 1, 32, 64, 4, 2),
    (2, 2, 2, 16, 16, 12, 4),
]


@pytest.mark.parametrize("rows, hq, hkv, d, block, ns, splits", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_decode_kernel_matches_reference(rows, hq, hkv, d, block, ns, splits, dtype):
    case = slot_case(rows, hq, hkv, d, block, ns, dtype, seed=rows + ns)
    ref, ref_lse = slot_decode_reference(**case, scale=d**-0.5)
    out, lse = slot_decode(**case, scale=d**-0.5, num_splits=splits)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert rel(out, ref) < TOL[dtype]
    torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-5)
    # one wrong block must show: the reference without one of the slots exceeds the tolerance
    dropped = dict(case, slots=case["slots"].clone())
    first = int((case["slots"][0, 0] >= 0).nonzero()[0])
    dropped["slots"][0, 0, first] = -1
    assert rel(slot_decode_reference(**dropped, scale=d**-0.5)[0], ref) > 5 * TOL[dtype]


def test_empty_heads_and_lse_merge():
    """A KV head with no valid slot gives out 0 and lse -inf; halves of the slots merged by lse give
    attention over all of them (what the offloaded decode does with hits and misses)."""
    case = slot_case(2, 4, 2, 16, 16, 6, torch.float32, seed=5, unused=0)
    case["slots"][1, 1] = -1
    out, lse = slot_decode(**case, scale=0.25, num_splits=2)
    assert torch.all(out[1, 2:] == 0) and torch.all(lse[1, 2:] == float("-inf"))
    assert torch.isfinite(lse[0]).all() and torch.isfinite(out).all()
    whole, whole_lse = slot_decode_reference(**case, scale=0.25)
    halves = []
    for part in (slice(0, 3), slice(3, 6)):
        sub = dict(case, slots=case["slots"][:, :, part].contiguous(), fill=case["fill"][:, :, part].contiguous())
        halves.append(slot_decode(**sub, scale=0.25))
    merged, merged_lse = merge_attention([h[0] for h in halves], [h[1] for h in halves])
    torch.testing.assert_close(merged, whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(merged_lse, whole_lse, atol=1e-5, rtol=1e-5)


def test_slot_decode_rejects_bad_input():
    case = slot_case(2, 4, 2, 16, 16, 3, torch.float32)
    with pytest.raises(ValueError, match="int64"):
        slot_decode(**dict(case, slots=case["slots"].int()), scale=0.1)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        slot_decode(**dict(case, q=case["q"][:, :3]), scale=0.1)
    with pytest.raises(ValueError, match="cis_dev must be float32"):
        slot_decode(**dict(case, cis_dev=case["cis_dev"].double()), scale=0.1)
    with pytest.raises(ValueError, match="caches disagree"):
        slot_decode_reference(**dict(case, cis_dev=case["cis_dev"][:, :8]), scale=0.1)
    with pytest.raises(ValueError, match="share one"):
        slot_decode(**dict(case, k_dev=case["k_dev"].bfloat16()), scale=0.1)
