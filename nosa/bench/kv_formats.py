"""How far a host KV format moves a real model (scripts/bench_kv_formats.py): the model's next-token
distribution with every layer's K and V round-tripped through a format, against the exact one.

RULER's scores move by whole examples, so a format's damage hides in their noise (3 examples per task
give a paired interval of about 15 points). This measures it directly on held-out prose: per format,
over the last half of each window (positions that read at least half a window of context), the mean
KL(exact || format) of the next-token distribution, how often the greedy token stays the same, and
the perplexity over the exact model's. K and V are round-tripped apart as well, to say which one a
format loses on, and two formats that are not served are measured as what-ifs (marked so): the
shipped formats store one scale per token and KV head (nosa.kvquant, the spec), and these show what
a per-block layout would buy.

Every token's K and V go through the format, the current block's too, which a server keeps on the
device in the model's dtype: an upper bound on what the host pool does to a served request. Only
the layers whose KV a server offloads: a hybrid model's sliding-window layers (Gemma 3) keep their
window on the device, exact, and are left so here.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from nosa import kvquant

F8, I8 = torch.float8_e4m3fn, torch.int8
WHATIF_BLOCK = 64  # tokens per block of the what-if layouts (the serving block of SmolLM2's checkpoints)


def per_token(dtype: torch.dtype, keys: bool = False) -> Callable:
    """The served format (nosa.kvquant): one scale per token and KV head; ``keys``: divided by the
    layer's key factors first when the checkpoint has them (served int8 keys). rt(x [B, H, T, D], factor
    [H, D] or None)."""
    def rt(x: torch.Tensor, factor: torch.Tensor | None = None) -> torch.Tensor:
        f = factor[:, None, :] if keys and factor is not None else None
        return kvquant.roundtrip(x, dtype, factor=f)
    return rt


def block_mean_removed(dtype: torch.dtype, block: int = WHATIF_BLOCK) -> Callable:
    """What-if: each block of ``block`` tokens less its per-channel mean (kept exact, D floats per block
    and KV head), the rest in the per-token format."""
    def rt(x: torch.Tensor, factor: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(x)
        for s in range(0, x.shape[2], block):
            xs = x[:, :, s:s + block].float()
            mean = xs.mean(dim=2, keepdim=True)
            out[:, :, s:s + block] = (kvquant.roundtrip(xs - mean, dtype) + mean).to(x.dtype)
        return out
    return rt


def per_channel(dtype: torch.dtype, block: int = WHATIF_BLOCK) -> Callable:
    """What-if (KIVI's keys): one scale per channel and KV head over each block of ``block`` tokens."""
    def rt(x: torch.Tensor, factor: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(x)
        for s in range(0, x.shape[2], block):
            xs = x[:, :, s:s + block].transpose(-1, -2)
            out[:, :, s:s + block] = kvquant.roundtrip(xs, dtype).transpose(-1, -2)
        return out
    return rt


def exact(x: torch.Tensor, factor: torch.Tensor | None = None) -> torch.Tensor:
    return x


# name -> (K's round trip, V's round trip, kind): "served" (a NOSA_HOST_KV_DTYPE: int8 keys with the
# checkpoint's key factors when it has them), "unfactored" (served int8 on a checkpoint without key
# factors), "apart" (a served format on K or V alone, the other exact: which one it loses on),
# "what-if" (a layout not served)
FORMATS: dict[str, tuple[Callable, Callable, str]] = {
    "int8": (per_token(I8, keys=True), per_token(I8), "served"),
    "int8, no key factors": (per_token(I8), per_token(I8), "unfactored"),
    "float8_e4m3fn": (per_token(F8), per_token(F8), "served"),
    "float8_e4m3fn, K only": (per_token(F8), exact, "apart"),
    "float8_e4m3fn, V only": (exact, per_token(F8), "apart"),
    f"float8_e4m3fn, K less its {WHATIF_BLOCK}-token block mean": (block_mean_removed(F8), per_token(F8), "what-if"),
    f"int8, K scaled per channel over {WHATIF_BLOCK} tokens": (per_channel(I8), per_token(I8), "what-if"),
}
ATTENTION = "nosa_kv_format"  # the attention implementation registered while measuring


def offloaded(module) -> bool:
    """Whether a server offloads this attention layer's KV: not a sliding-window layer's (its window
    stays on the device)."""
    return not getattr(module, "sliding_window", None)


def _attention(state: dict):
    """An HF attention function: SDPA over K and V round-tripped as ``state["format"]`` says (with the
    layer's key factors, ``state["factors"]``, where the format takes them)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward  # optional: transformers

    def forward(module, query, key, value, attention_mask, **kwargs):
        name = state.get("format")
        if name is not None and offloaded(module):
            k_rt, v_rt, _ = FORMATS[name]
            factors = state.get("factors") or {}
            key, value = k_rt(key, factors.get(module.layer_idx)), v_rt(value)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return forward


def prose_windows(tokenizer, length: int, windows: int) -> list[torch.Tensor]:
    """``windows`` consecutive windows of ``length`` tokens of nosa.train.prose's held-out documents
    (prose.token_windows: each starts with the tokenizer's BOS where it has one)."""
    from nosa.train import prose  # optional: the train extra's prose (CPython's own sources)

    _, heldout = prose.split(prose.documents())
    try:
        return [torch.tensor([ids]) for ids in prose.token_windows(tokenizer, heldout, length, windows)]
    except ValueError as e:
        raise SystemExit(f"bench_kv_formats: {e}") from None


def measure(model_path: str, length: int, windows: int, formats: list[str], progress: bool = True) -> dict:
    """Per format: KL(exact || format), greedy agreement and perplexity over exact, means over the last
    half of each window; with the bytes per token a host pool of that format stores (shipped formats)."""
    from tqdm import tqdm  # optional: tqdm (the train extra)
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer  # optional: transformers
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # optional: transformers

    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise SystemExit(f"bench_kv_formats: unknown formats {unknown}; known: {list(FORMATS)}")
    from nosa.kv_calibrate import load_key_factors  # optional: safetensors (the checkpoint reader's)

    state: dict = {"factors": load_key_factors(model_path)}
    AttentionInterface.register(ATTENTION, _attention(state))
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)  # SDPA's masks: sliding windows included
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, attn_implementation=ATTENTION).eval()
    rows = prose_windows(tokenizer, length, windows)
    tail = length // 2

    def log_probs() -> list[torch.Tensor]:
        with torch.no_grad():
            return [torch.log_softmax(model(r).logits[0, -tail - 1:-1].float(), dim=-1) for r in rows]

    state["format"] = None
    ref = log_probs()
    targets = [r[0, -tail:] for r in rows]
    ref_nll = sum(-float(p.gather(-1, t[:, None]).mean()) for p, t in zip(ref, targets)) / windows
    text = model.config.get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    dtype = torch.bfloat16  # the pool a GPU server would hold; bytes per (token, KV head, layer) with cis
    out = []
    for name in tqdm(formats, desc="formats", unit="format", disable=not progress, dynamic_ncols=True):
        state["format"] = name
        got = log_probs()
        kl = sum(float((p.exp() * (p - g)).sum(-1).mean()) for p, g in zip(ref, got)) / windows
        agree = sum(float((p.argmax(-1) == g.argmax(-1)).float().mean()) for p, g in zip(ref, got)) / windows
        nll = sum(-float(g.gather(-1, t[:, None]).mean()) for g, t in zip(got, targets)) / windows
        kind = FORMATS[name][2]
        row = {"format": name, "kind": kind, "kl": kl, "greedy_agreement": agree, "ppl_ratio": math.exp(nll - ref_nll)}
        if kind == "served":
            q = kvquant.HOST_KV_DTYPES[name]
            row["bytes_per_token_vs_bf16"] = (kvquant.bytes_per_token(head_dim, head_dim, q)
                                              / kvquant.bytes_per_token(head_dim, head_dim, dtype))
        out.append(row)
    state["format"] = None
    layers = [m for m in model.modules() if hasattr(m, "k_proj")]
    return {"model": model_path, "length": length, "windows": windows, "scored_positions": windows * tail,
            "exact_ppl": math.exp(ref_nll), "layers_quantized": sum(map(offloaded, layers)), "layers": len(layers),
            "key_factors": state["factors"] is not None, "formats": out}
