"""The quantized host KV format (``NOSA_HOST_KV_DTYPE``): the spec the recall kernels are tested against.

With offloading the host pool may store K and V in one byte per element (``int8`` or
``float8_e4m3fn``) instead of the model's dtype; the device block cache stays in the model's dtype,
so attention is unchanged, and a recall dequantizes as it copies. The eviction scores (cis) and the
compressed keys the selection reads stay exact.

Scales: one float32 scale per (token, KV head), keys and values apart: ``scale = amax(|y|) / QMAX``
over the head's D channels, ``q = y / scale`` rounded (int8: to nearest, ties to even, then
clamped to +-127; fp8: torch's round-to-nearest-even cast after clamping to +-448). For values and
fp8 keys ``y = x``. int8 keys are first divided by the checkpoint's **key factors** (``y = x / f``,
one float32 factor per layer, KV head and channel; ``KEY_FACTORS_FILE``, written by
``python -m nosa.kv_calibrate``) when it has them: a few channels of a key are far larger than the
rest, and one scale per token would leave the others few of int8's levels; dividing each channel
by its calibrated range gives every channel the same share (KIVI's per-channel key scales, made
static). A token is quantized once, when it is written, and never again: the tokens of a block that
is still filling round-trip exactly as they will once the block is complete (per-block scales, or
KIVI's per-channel scales over a block, would have to re-quantize the earlier tokens whenever a
later one widens the block's range, or hold them exact until the block completes and then change
them). The cost: 4 bytes of scale per D bytes of data, and D factors per layer and KV head.

``dequantize(q, scale, dtype, factor) = (float32(q) * scale * factor).to(dtype)`` (``factor`` 1
where there are none): float32 multiplies left to right, one rounding to the model dtype; the CPU
path and the Triton kernel (nosa.kernels.recall) compute exactly this.

Round-trip bounds, per element, in float32 before the final rounding to the model dtype:
- int8: ``|x - x'| <= f * scale / 2`` (= f * amax(|y|) / 254; f = 1 without factors);
- fp8 e4m3: ``|x - x'| <= |x| * 2**-4 + scale * 2**-10`` (3 mantissa bits; subnormals below 2**-6).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

HOST_KV_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "float8_e4m3fn": torch.float8_e4m3fn}
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float32
KEY_FACTORS_FILE = "nosa_kv_factors.safetensors"  # a checkpoint's key factors (python -m nosa.kv_calibrate)
FACTOR_FLOOR = 1 / 64  # no factor below this share of its head's largest: a channel calibration saw near
#                        zero cannot take over a token's scale if it grows at serving time


class QuantizedItems(NamedTuple):
    """A host pool tensor stored quantized, as items along dim 0: ``data`` [N, B, D] int8 / fp8 and
    ``scale`` [N, B] float32 (one per token of the item); it dequantizes to ``dtype``. ``factor``:
    the key factors [Hkv, D] float32 of int8 keys (None: none), item m being KV head m % Hkv (the
    host pool's page-major items), kept on the device that dequantizes. What nosa.ops.copy_items
    takes in place of a source tensor to dequantize on the way."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype
    factor: torch.Tensor | None = None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def is_cuda(self) -> bool:
        return self.data.is_cuda

    def is_pinned(self) -> bool:
        return self.data.is_pinned() and self.scale.is_pinned()

    def item_bytes(self) -> int:
        """Bytes one item moves: its data and its scales."""
        return self.data[0].numel() * self.data.element_size() + self.scale[0].numel() * self.scale.element_size()


def host_kv_dtype(name: str | None, model_dtype: torch.dtype) -> torch.dtype:
    """The host pool's K/V dtype for ``NOSA_HOST_KV_DTYPE`` = ``name`` (None or "" or "auto": the
    model's dtype); ValueError naming the accepted values otherwise."""
    if name in (None, "", "auto"):
        return model_dtype
    if name in HOST_KV_DTYPES:
        return HOST_KV_DTYPES[name]
    if name == str(model_dtype).removeprefix("torch."):
        return model_dtype
    raise ValueError(f"NOSA_HOST_KV_DTYPE={name!r}: expected one of {', '.join(HOST_KV_DTYPES)}, or the model's "
                     f"dtype ({str(model_dtype).removeprefix('torch.')}), or unset")


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def quantize(x: torch.Tensor, dtype: torch.dtype, check_finite: bool = True,
             factor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (q [..., D] ``dtype``, scale [...] float32), one scale per row of D channels.
    ``factor``: key factors broadcasting against x (e.g. [Hkv, D] for x [T, Hkv, D]), x divided by
    them first. ``check_finite``: ValueError if x holds inf or nan (a host read: callers inside a
    captured CUDA step pass False, and a non-finite row then dequantizes to nan)."""
    if dtype not in QMAX:
        raise ValueError(f"quantize: dtype {dtype} is not a host KV format ({', '.join(map(str, QMAX))})")
    xf = x.float()
    if check_finite and not bool(torch.isfinite(xf).all()):
        bad = (~torch.isfinite(xf)).nonzero()[0].tolist()
        raise ValueError(f"quantize: the KV holds inf or nan (first at index {bad} of shape {tuple(x.shape)}); "
                         "a quantized host pool cannot store it")
    if factor is not None:
        xf = xf / factor.to(xf.device, torch.float32)
    qmax = QMAX[dtype]
    scale = xf.abs().amax(dim=-1) / qmax
    y = xf / torch.where(scale > 0, scale, 1.0)[..., None]
    if dtype == torch.int8:
        q = torch.round(y).clamp(-qmax, qmax).to(torch.int8)
    else:
        q = y.clamp(-qmax, qmax).to(dtype)
    return q, scale.to(SCALE_DTYPE)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
               factor: torch.Tensor | None = None) -> torch.Tensor:
    """(q [..., D], scale [...]) -> [..., D] ``dtype``: float32(q) * scale (* factor), rounded once."""
    x = q.float() * scale.float()[..., None]
    if factor is not None:
        x = x * factor.to(x.device, torch.float32)
    return x.to(dtype)


def roundtrip(x: torch.Tensor, dtype: torch.dtype, check_finite: bool = True,
              factor: torch.Tensor | None = None) -> torch.Tensor:
    """x as a host pool of ``dtype`` gives it back (x itself when ``dtype`` is not quantized);
    ``factor`` as ``quantize`` takes it."""
    if not is_quantized(dtype):
        return x
    return dequantize(*quantize(x, dtype, check_finite, factor), x.dtype, factor)


def error_bound(x: torch.Tensor, dtype: torch.dtype, factor: torch.Tensor | None = None) -> torch.Tensor:
    """The largest |x - dequantize(quantize(x))| allowed per element, in float32 (before the final
    rounding to the model dtype): the bounds of the module docstring."""
    xf = x.float()
    f = torch.ones(()) if factor is None else factor.float()
    y = xf / f
    scale = (y.abs().amax(dim=-1) / QMAX[dtype])[..., None]
    if dtype == torch.int8:
        return (f * scale / 2).expand_as(xf)
    return xf.abs() * 2.0**-4 + scale * 2.0**-10


def key_factors(amax: torch.Tensor) -> torch.Tensor:
    """Key factors [..., D] float32 from the calibrated largest |key| per channel ``amax`` [..., D]:
    each head's scaled to a largest factor of 1, none below FACTOR_FLOOR (a head calibration saw only
    zeros gets ones)."""
    a = amax.float()
    top = a.amax(dim=-1, keepdim=True)
    f = torch.where(top > 0, a / torch.where(top > 0, top, 1.0), 1.0)
    return f.clamp(min=FACTOR_FLOOR).contiguous()


def bytes_per_token(head_dim: int, v_head_dim: int, kv_dtype: torch.dtype) -> int:
    """Host bytes per (token, KV head, layer): K and V (and their scales when quantized), plus the
    float32 eviction score (cis)."""
    scales = 2 * SCALE_DTYPE.itemsize if is_quantized(kv_dtype) else 0
    return (head_dim + v_head_dim) * kv_dtype.itemsize + scales + 4
