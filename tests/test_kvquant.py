"""The quantized host KV format (nosa.kvquant) and the recall that dequantizes it (nosa.ops.copy_items
with QuantizedItems sources): round-trip bounds, bad input, and every implementation against the
spec, bit for bit. The Triton kernel runs under TRITON_INTERPRET=1 without CUDA (conftest.py)."""

import pytest
import torch

from nosa import kvquant, ops
from nosa.kernels import resolve_cpu
from nosa.kernels.recall import copy_items_dequant_reference, copy_items_dequant_triton
from nosa.kvquant import QuantizedItems, dequantize, error_bound, quantize

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = [torch.int8, torch.float8_e4m3fn]


def adversarial(d: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rows = {
        "random": torch.randn(32, d, generator=g) * 3,
        "all_equal": torch.full((4, d), -1.75),
        "one_outlier": torch.randn(4, d, generator=g) * 0.01,
        "zeros": torch.zeros(3, d),
        "tiny": torch.randn(4, d, generator=g) * 1e-30,
        "large": torch.randn(4, d, generator=g) * 1e4,
    }
    rows["one_outlier"][:, 7] = 300.0
    return rows


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", list(adversarial()))
def test_roundtrip_within_the_formats_bound(fmt, case):
    x = adversarial()[case]
    q, scale = quantize(x, fmt)
    assert q.dtype == fmt and scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    back = dequantize(q, scale, torch.float32)
    err = (back - x).abs()
    assert bool((err <= error_bound(x, fmt) * (1 + 1e-6)).all()), f"worst {float(err.max())}"
    if case in ("zeros", "all_equal"):
        assert torch.equal(back, x)  # exactly representable: amax maps to QMAX, zero to zero
    # the bound is tight enough to catch a wrong scale (e.g. amax / 255 for int8 halves nothing, / 64 breaks it)
    if case == "random":
        assert float(err.max()) > 0.2 * float(error_bound(x, fmt).max())


@pytest.mark.parametrize("fmt", FORMATS)
def test_model_dtype_roundtrip_is_one_rounding_of_the_float32_result(fmt):
    x = adversarial()["random"].bfloat16()
    q, scale = quantize(x, fmt)
    assert torch.equal(dequantize(q, scale, torch.bfloat16), (q.float() * scale[:, None]).bfloat16())
    assert torch.equal(kvquant.roundtrip(x, fmt), dequantize(q, scale, torch.bfloat16))
    assert kvquant.roundtrip(x, torch.bfloat16) is x


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_kv_is_rejected_with_a_clear_error(bad):
    x = torch.randn(4, 16)
    x[2, 5] = bad
    with pytest.raises(ValueError, match=r"inf or nan \(first at index \[2, 5\]"):
        quantize(x, torch.int8)


def test_a_filling_block_roundtrips_as_the_complete_block_will():
    """Tokens are quantized one by one as they are written: the first n tokens of a block read back
    the same before and after the rest of the block arrives (scales are per token, never revised)."""
    block = torch.randn(64, 2, 32) * torch.linspace(0.1, 50, 64)[:, None, None]  # later tokens are larger
    for fmt in FORMATS:
        q_all, s_all = quantize(block, fmt)
        for n in (1, 17, 63):
            q_n, s_n = quantize(block[:n], fmt)
            assert torch.equal(q_n.view(torch.uint8), q_all[:n].view(torch.uint8)) and torch.equal(s_n, s_all[:n])


def test_host_kv_dtype_names():
    assert kvquant.host_kv_dtype(None, torch.bfloat16) == torch.bfloat16
    assert kvquant.host_kv_dtype("bfloat16", torch.bfloat16) == torch.bfloat16
    assert kvquant.host_kv_dtype("int8", torch.bfloat16) == torch.int8
    assert kvquant.host_kv_dtype("float8_e4m3fn", torch.float16) == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="NOSA_HOST_KV_DTYPE='int4': expected one of int8, float8_e4m3fn"):
        kvquant.host_kv_dtype("int4", torch.bfloat16)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_host_bytes_per_token_at_most_055_of_bf16(head_dim):
    full = kvquant.bytes_per_token(head_dim, head_dim, torch.bfloat16)
    for fmt in FORMATS:
        assert kvquant.bytes_per_token(head_dim, head_dim, fmt) / full <= 0.55


# ---- the recall ----------------------------------------------------------------------------------
def quantized_pool(items, block, d, fmt, dtype, seed=0):
    """A host pool of ``items`` (block, KV head) items: K and V quantized, cis float32; values with
    an outlier channel and a few all-zero tokens."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(items, block, d, generator=g) * 2
    k[..., 3] *= 40  # an outlier channel
    v = torch.randn(items, block, d, generator=g)
    v[0, :5] = 0
    cis = torch.randn(items, block, generator=g)
    qk, qv = (QuantizedItems(*quantize(t.to(dtype), fmt), dtype) for t in (k, v))
    return qk, qv, cis


def spec(dst, src, dst_idx, src_idx):
    """A plain loop: dst item d <- dequantize(src item s) for each pair with s >= 0."""
    out = [t.clone() for t in dst]
    for d, s in zip(dst_idx.tolist(), src_idx.tolist()):
        if s >= 0:
            for o, x in zip(out, src):
                o[d] = dequantize(x.data[s], x.scale[s], o.dtype) if isinstance(x, QuantizedItems) else x[s]
    return out


IMPLS = {"reference": copy_items_dequant_reference, "triton": copy_items_dequant_triton, "ops": ops.copy_items,
         "cpu_kernel": resolve_cpu.copy_items_dequant}


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_recall_dequantizes_exactly_as_the_spec(impl, fmt, dtype):
    block, d, slots = 16, 32, 9
    qk, qv, cis = quantized_pool(12, block, d, fmt, dtype)
    src = [QuantizedItems(qk.data.to(DEVICE), qk.scale.to(DEVICE), dtype),
           QuantizedItems(qv.data.to(DEVICE), qv.scale.to(DEVICE), dtype), cis.to(DEVICE)]
    dst = [torch.zeros(slots, block, d, dtype=dtype, device=DEVICE), torch.zeros(slots, block, d, dtype=dtype,
                                                                              device=DEVICE),
           torch.zeros(slots, block, device=DEVICE)]
    dst_idx = torch.tensor([4, 0, 8, 2, 7, 5], device=DEVICE)
    src_idx = torch.tensor([11, 0, -1, 6, 3, -1], device=DEVICE)  # -1: padding, its dst never written
    want = spec([t.cpu() for t in dst], [QuantizedItems(qk.data, qk.scale, dtype), QuantizedItems(qv.data, qv.scale,
                                                                                                   dtype), cis],
                dst_idx.cpu(), src_idx.cpu())
    if impl == "cpu_kernel" and (DEVICE == "cuda" or resolve_cpu.library() is None):
        pytest.skip("the C++ loop runs on CPU tensors, with a C++ compiler")
    IMPLS[impl](dst, src, dst_idx, src_idx)
    for got, w in zip(dst, want):
        assert torch.equal(got.cpu(), w)
    assert not bool(dst[0][8].any()) and not bool(dst[0][1].any())  # padding and untouched slots stay zero


def test_recall_of_a_quantized_pool_rejects_bad_input():
    qk, qv, cis = quantized_pool(4, 8, 16, torch.int8, torch.bfloat16)
    idx = torch.tensor([0, 1])
    dst = [torch.zeros(3, 8, 16, dtype=torch.bfloat16), torch.zeros(3, 8, 16, dtype=torch.bfloat16), torch.zeros(3, 8)]
    with pytest.raises(ValueError, match="dequantizes to"):
        ops.copy_items([dst[0].float()], [qk], idx, idx)
    with pytest.raises(ValueError, match="item shapes differ"):
        ops.copy_items([dst[0][:, :4]], [qk], idx, idx)
    with pytest.raises(ValueError, match="scales must be float32"):
        ops.copy_items([dst[0]], [QuantizedItems(qk.data, qk.scale.half(), torch.bfloat16)], idx, idx)
    with pytest.raises(ValueError, match="int64"):
        ops.copy_items(dst, [qk, qv, cis], idx.int(), idx)
    with pytest.raises(ValueError, match="outside"):
        copy_items_dequant_reference(dst, [qk, qv, cis], idx, torch.tensor([0, 4]))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", FORMATS)
def test_recall_dequantizes_from_pinned_host_memory(fmt):
    """On CUDA the kernel reads the quantized pool and its scales from pinned host memory (UVA)."""
    qk, qv, cis = quantized_pool(64, 64, 128, fmt, torch.bfloat16)
    src = [QuantizedItems(t.data.pin_memory(), t.scale.pin_memory(), torch.bfloat16) for t in (qk, qv)]
    src.append(cis.pin_memory())
    dst = [torch.zeros(20, 64, 128, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
    dst.append(torch.zeros(20, 64, device="cuda"))
    dst_idx = torch.arange(16, device="cuda")
    src_idx = torch.randperm(64, device="cuda")[:16]
    src_idx[5] = -1
    want = spec([t.cpu() for t in dst], [qk, qv, cis], dst_idx.cpu(), src_idx.cpu())
    ops.copy_items(dst, src, dst_idx, src_idx)
    torch.cuda.synchronize()
    for got, w in zip(dst, want):
        assert torch.equal(got.cpu(), w)


@pytest.mark.parametrize("fmt", [torch.int8, torch.float8_e4m3fn])
def test_the_pools_dtype_changes_no_selected_block(fmt):
    """The serving decode step (nosa.bench.decode_harness, offloading on) with a quantized host pool
    against the model-dtype pool, same inputs: every step selects the same blocks in every layer and
    row (the compressed keys and eviction scores stay exact), while the outputs differ by the recalled
    blocks' rounding (the quantized pool is the one attended)."""
    from nosa import NosaConfig
    from nosa.bench.decode_harness import DecodeHarness

    cfg = NosaConfig(block_size=16, compress_kernel=8, compress_stride=4, sink_blocks=1, window_blocks=3,
                     topk_blocks=8, query_blocks=3, dense_len=64)
    exact, quantized = (DecodeHarness(cfg, [40, 150, 203], offload=True, seed=1, host_kv_dtype=d) for d in (None, fmt))
    differ = 0.0
    for step in range(30):
        q, k, v = exact.new_tokens(step)
        outs = []
        for h in (exact, quantized):
            h.begin([1, 2, 3])
            outs.append(h.forward(q, k, v))
        for layer, (a, b) in enumerate(zip(exact.states.pool.selection, quantized.states.pool.selection)):
            assert torch.equal(a[1:], b[1:]), (step, layer)
        differ = max(differ, float((outs[0] - outs[1]).abs().max()))
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0.3)
    assert differ > 1e-3
    assert quantized.engine.cache.stats["misses"][0] > 0  # blocks were recalled (dequantized) every few steps
