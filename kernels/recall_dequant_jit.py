"""The Triton kernel of a recall from a quantized host pool (nosa.kernels.recall.copy_items_dequant_triton;
the spec is nosa.kvquant.dequantize). A module of its own because its helpers must be module-level
@triton.jit functions; it imports triton, so nosa.kernels.recall loads it only when a kernel runs."""

import triton
import triton.language as tl


@triton.jit
def fp8_e4m3_to_f32(bits):
    """float8_e4m3fn bytes (uint8) -> float32, exactly (from the bits; the NaN code is never
    written, nosa.kvquant clamps to +-448)."""
    b = bits.to(tl.int32)
    exp = (b >> 3) & 15
    man = b & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)  # 2^(exp-7) * (1 + man/8)
    sub = man.to(tl.float32) * 0.001953125  # exp 0: man * 2^-9
    val = tl.where(exp == 0, sub, normal)
    return tl.where((b & 128) != 0, -val, val)

@triton.jit
def f32_to_bf16_bits(x):
    """float32 -> the bits of the bfloat16 nearest (ties to even), as int16: the rounding of
    torch's .to(torch.bfloat16), written out because Triton's interpreter truncates instead."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def one_pair(DST, SRC, SCALE, FACTOR, d, s, offs, ok, KIND: tl.constexpr, W: tl.constexpr, R: tl.constexpr,
             BF16: tl.constexpr, H: tl.constexpr):
    mask = ok & (offs < W)
    if KIND == 0:
        x = tl.load(SRC + s * W + offs, mask=mask, cache_modifier=".cg")
    else:
        raw = tl.load(SRC + s * W + offs, mask=mask, other=0, cache_modifier=".cg")
        if KIND == 1:
            xf = raw.to(tl.float32)
        else:
            xf = fp8_e4m3_to_f32(raw)
        scale = tl.load(SCALE + s * (W // R) + offs // R, mask=mask, other=0.0)
        y = xf * scale
        if H > 0:  # key factors [H, R]: item s is KV head s % H
            y = y * tl.load(FACTOR + (s % H) * R + offs % R, mask=mask, other=0.0)
        if BF16:  # DST is the bf16 buffer seen as int16
            x = f32_to_bf16_bits(y)
        else:
            x = y.to(DST.dtype.element_ty)
    tl.store(DST + d * W + offs, x, mask=mask)


@triton.jit
def copy_dequant_kernel(DST_IDX, SRC_IDX, D0, S0, C0, F0, D1, S1, C1, F1, D2, S2, C2, F2, NPAIRS: tl.constexpr,
                        K0: tl.constexpr, W0: tl.constexpr, R0: tl.constexpr, B0: tl.constexpr, H0: tl.constexpr,
                        K1: tl.constexpr, W1: tl.constexpr, R1: tl.constexpr, B1: tl.constexpr, H1: tl.constexpr,
                        K2: tl.constexpr, W2: tl.constexpr, R2: tl.constexpr, B2: tl.constexpr, H2: tl.constexpr,
                        CHUNK: tl.constexpr):
    m = tl.program_id(0)
    offs = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
    s = tl.load(SRC_IDX + m)
    ok = s >= 0
    d = tl.where(ok, tl.load(DST_IDX + m), 0)  # a padded entry's dst may be anything: never use it
    s = tl.where(ok, s, 0)
    one_pair(D0, S0, C0, F0, d, s, offs, ok, K0, W0, R0, B0, H0)
    if NPAIRS > 1:
        one_pair(D1, S1, C1, F1, d, s, offs, ok, K1, W1, R1, B1, H1)
    if NPAIRS > 2:
        one_pair(D2, S2, C2, F2, d, s, offs, ok, K2, W2, R2, B2, H2)
