"""The quantized host KV format (nosa.kvquant) and the recall that dequantizes it (nosa.ops.copy_items
with QuantizedItems sources): round-trip bounds, bad input, and every implementation against the
spec, bit for bit. The Triton kernel runs under TRITON_INTERPRET=1 without CUDA (conftest.py)."""

import pytest
import torch

from nosa import kv_calibrate, kvquant, ops
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
    the same before and after the rest of the block arrives (scales are per token, never revised;
    int8 keys' factors are the checkpoint's, not the block's)."""
    block = torch.randn(64, 2, 32) * torch.linspace(0.1, 50, 64)[:, None, None]  # later tokens are larger
    factor = key_like_factors(2, 32)  # int8 keys' factors are fixed before any token is written
    for fmt, f in [(fmt, None) for fmt in FORMATS] + [(torch.int8, factor)]:
        q_all, s_all = quantize(block, fmt, factor=f)
        for n in (1, 17, 63):
            q_n, s_n = quantize(block[:n], fmt, factor=f)
            assert torch.equal(q_n.view(torch.uint8), q_all[:n].view(torch.uint8)) and torch.equal(s_n, s_all[:n])


def test_key_factors_shrink_int8_error_on_keys_with_outlier_channels():
    """Keys with a few large channels: with the key factors every channel keeps its share of int8's
    levels (the round trip stays within its bound), and the small channels' error shrinks by about
    the outlier's size; dividing but not multiplying back (a dequantize that forgot the factors) is
    far off."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 2, 64, generator=g)
    x[..., 5] *= 30
    x[..., 40] *= -12
    factor = kvquant.key_factors(x.abs().amax(dim=0))  # [2, 64] calibrated on the keys themselves
    assert factor.shape == (2, 64) and float(factor.max()) == 1.0 and float(factor.min()) >= kvquant.FACTOR_FLOOR
    q, scale = quantize(x, torch.int8, factor=factor)
    back = dequantize(q, scale, torch.float32, factor)
    err = (back - x).abs()
    assert bool((err <= error_bound(x, torch.int8, factor) * (1 + 1e-6)).all())
    plain = (kvquant.roundtrip(x, torch.int8) - x).abs()
    small = [c for c in range(64) if c not in (5, 40)]
    assert float(err[..., small].mean()) < float(plain[..., small].mean()) / 5
    assert float((dequantize(q, scale, torch.float32) - x).abs().mean()) > 10 * float(err.mean())


def test_key_factors_floor_and_heads_without_data():
    amax = torch.tensor([[4.0, 2.0, 0.0, 1e-6], [0.0, 0.0, 0.0, 0.0]])
    f = kvquant.key_factors(amax)
    assert torch.equal(f[0], torch.tensor([1.0, 0.5, kvquant.FACTOR_FLOOR, kvquant.FACTOR_FLOOR]))
    assert torch.equal(f[1], torch.ones(4))  # calibration saw only zeros: plain per-token scales


def test_key_factors_file_roundtrip_and_bad_files(tmp_path):
    factors = {0: key_like_factors(2, 8), 5: key_like_factors(2, 8, seed=1)}
    assert kv_calibrate.load_key_factors(str(tmp_path)) is None  # none written: the server uses no factors
    path = kv_calibrate.save_key_factors(str(tmp_path), factors, {"calibration": "test"})
    assert sorted(p.name for p in tmp_path.iterdir()) == [kvquant.KEY_FACTORS_FILE]  # no temporary left
    got = kv_calibrate.load_key_factors(str(tmp_path))
    assert got.keys() == factors.keys() and all(torch.equal(got[i], factors[i]) for i in factors)
    with pytest.raises(ValueError, match="finite positive"):
        kv_calibrate.save_key_factors(str(tmp_path), {0: torch.zeros(2, 8)}, {})
    assert torch.equal(kv_calibrate.load_key_factors(str(tmp_path))[5], factors[5])  # the old file is intact
    from safetensors.torch import save_file

    save_file({"layers.1.v": torch.ones(2, 8)}, path)
    with pytest.raises(ValueError, match=r"unexpected tensor 'layers.1.v'"):
        kv_calibrate.load_key_factors(str(tmp_path))
    save_file({"layers.1.k": -torch.ones(2, 8)}, path)
    with pytest.raises(ValueError, match="finite positive factors"):
        kv_calibrate.load_key_factors(str(tmp_path))


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
def key_like_factors(hkv, d, seed=0):
    """Key factors [hkv, d] as nosa.kvquant.key_factors makes them: channel 3 the largest."""
    g = torch.Generator().manual_seed(seed)
    amax = torch.rand(hkv, d, generator=g) + 0.5
    amax[:, 3] = 40.0
    return kvquant.key_factors(amax)


def quantized_pool(items, block, d, fmt, dtype, seed=0, hkv=None):
    """A host pool of ``items`` (block, KV head) items: K and V quantized, cis float32; values with
    an outlier channel and a few all-zero tokens. ``hkv``: K with key factors for that many KV heads
    (item m is head m % hkv)."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(items, block, d, generator=g) * 2
    k[..., 3] *= 40  # an outlier channel
    v = torch.randn(items, block, d, generator=g)
    v[0, :5] = 0
    cis = torch.randn(items, block, generator=g)
    factor = None if hkv is None else key_like_factors(hkv, d)
    per_item = None if factor is None else factor[torch.arange(items) % hkv, None]
    qk = QuantizedItems(*quantize(k.to(dtype), fmt, factor=per_item), dtype, factor)
    qv = QuantizedItems(*quantize(v.to(dtype), fmt), dtype)
    return qk, qv, cis


def spec(dst, src, dst_idx, src_idx):
    """A plain loop: dst item d <- dequantize(src item s) for each pair with s >= 0 (item s of a
    source with key factors is KV head s % Hkv)."""
    out = [t.clone() for t in dst]
    for d, s in zip(dst_idx.tolist(), src_idx.tolist()):
        if s >= 0:
            for o, x in zip(out, src):
                if not isinstance(x, QuantizedItems):
                    o[d] = x[s]
                    continue
                factor = None if x.factor is None else x.factor[s % x.factor.shape[0]]
                o[d] = dequantize(x.data[s], x.scale[s], o.dtype, factor)
    return out


def _operator(dst, src, dst_idx, src_idx):
    """The operator a compiled decode step records (torch.ops.nosa.copy_items_dequant), called directly."""
    none = torch.empty(0)
    factors = [none if getattr(s, "factor", None) is None else s.factor for s in src]
    torch.ops.nosa.copy_items_dequant(dst, [getattr(s, "data", s) for s in src],
                                      [getattr(s, "scale", none) for s in src], factors, dst_idx, src_idx)


IMPLS = {"reference": copy_items_dequant_reference, "triton": copy_items_dequant_triton, "ops": ops.copy_items,
         "cpu_kernel": resolve_cpu.copy_items_dequant, "operator": _operator}


@pytest.mark.parametrize("impl", list(IMPLS))
@pytest.mark.parametrize("fmt,hkv", [(torch.int8, None), (torch.float8_e4m3fn, None), (torch.int8, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_recall_dequantizes_exactly_as_the_spec(impl, fmt, hkv, dtype):
    block, d, slots = 16, 32, 9
    qk, qv, cis = quantized_pool(12, block, d, fmt, dtype, hkv=hkv)
    factor = None if qk.factor is None else qk.factor.to(DEVICE)
    src = [QuantizedItems(qk.data.to(DEVICE), qk.scale.to(DEVICE), dtype, factor),
           QuantizedItems(qv.data.to(DEVICE), qv.scale.to(DEVICE), dtype), cis.to(DEVICE)]
    dst = [torch.zeros(slots, block, d, dtype=dtype, device=DEVICE), torch.zeros(slots, block, d, dtype=dtype,
                                                                              device=DEVICE),
           torch.zeros(slots, block, device=DEVICE)]
    dst_idx = torch.tensor([4, 0, 8, 2, 7, 5], device=DEVICE)
    src_idx = torch.tensor([11, 0, -1, 6, 3, -1], device=DEVICE)  # -1: padding, its dst never written
    want = spec([t.cpu() for t in dst], [qk, qv, cis], dst_idx.cpu(), src_idx.cpu())
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
    with pytest.raises(ValueError, match=r"key factors must be contiguous float32 \[Hkv, D\]"):
        ops.copy_items([dst[0]], [qk._replace(factor=torch.ones(2, 8))], idx, idx)
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


@pytest.mark.parametrize("fmt,factored", [(torch.int8, False), (torch.int8, True), (torch.float8_e4m3fn, False)])
def test_the_pools_dtype_changes_no_selected_block(fmt, factored):
    """The serving decode step (nosa.bench.decode_harness, offloading on) with a quantized host pool
    against the model-dtype pool, same inputs: every step selects the same blocks in every layer and
    row (the compressed keys and eviction scores stay exact), while the outputs differ by the recalled
    blocks' rounding (the quantized pool is the one attended)."""
    from nosa import NosaConfig
    from nosa.bench.decode_harness import DecodeHarness

    cfg = NosaConfig(block_size=16, compress_kernel=8, compress_stride=4, sink_blocks=1, window_blocks=3,
                     topk_blocks=8, query_blocks=3, dense_len=64)
    factors = [key_like_factors(2, 16, seed=layer) for layer in range(2)] if factored else None
    exact = DecodeHarness(cfg, [40, 150, 203], offload=True, seed=1)
    quantized = DecodeHarness(cfg, [40, 150, 203], offload=True, seed=1, host_kv_dtype=fmt, key_factors=factors)
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
