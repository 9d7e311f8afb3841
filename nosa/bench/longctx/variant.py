"""One variant of scripts/bench_longctx.py on one example: the variant (a model and its budget), the
dense context prefill it continues from, its greedy reply and the selection statistics of its
decode steps, its perplexity on a window, and the cache of dense results by checkpoint digest."""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
from dataclasses import dataclass
from fractions import Fraction

import torch
import torch.nn.functional as F
from transformers import DynamicCache

import nosa
from nosa import nosa_prefill
from nosa.bench.longctx.config import PICKS, WINDOWS, budget_config
from nosa.eviction import MODULE_NAME
from nosa.hf import capture_attention_inputs, nosa_attention_modules
from nosa.kvquant import KEY_FACTORS_FILE
from nosa.select import blocks_entering
from nosa.train.metrics import selection_mass

PPL_TAIL = 1024  # perplexity: tokens scored at the end of each window (half the window if shorter)


@dataclass
class Variant:
    name: str  # "dense", "A = 0, 1/4", "<label>, 1/8", "<label>, 1/8, picks 1/8"
    model: object  # transformers model; dense and A = 0 variants share one
    share: int | None  # budget = 1/share of the context's blocks; None: dense attention
    base: str  # variants with one base share the dense context prefill
    picks: Fraction = PICKS  # share of the budget for free query-aware picks
    host_dtype: torch.dtype | None = None  # NOSA_HOST_KV_DTYPE's quantized pool (nosa.hf.host_kv_dtype)
    key_factors: dict | None = None  # its int8 keys' factors by layer (nosa.kv_calibrate.load_key_factors)
    windows: tuple[int, int] = WINDOWS  # the compressed windows' (kernel, stride) in tokens

    def config(self, length: int):
        """This variant's NosaConfig at ``length`` tokens (None: dense)."""
        return None if self.share is None else budget_config(length, self.share, self.picks, self.windows)

    def prepare(self, length: int):
        """Set the model's attention for this variant at ``length``; returns its NosaConfig (None: dense)."""
        cfg = self.config(length)
        if cfg is None:
            self.model.set_attn_implementation("sdpa")
            return None
        nosa.convert(self.model, cfg)  # keeps the model's eviction heads, sets the budget
        for _, module in nosa_attention_modules(self.model):  # attention over K / V as the host pool returns them
            module.__dict__.pop("_nosa_states", None)
            if self.host_dtype is None:
                module.__dict__.pop("_nosa_host_kv", None)
            else:
                factor = None if self.key_factors is None else self.key_factors[module.layer_idx]
                module._nosa_host_kv = (self.host_dtype, factor)
        return cfg  # (every run starts with a prefill of several rows, which drops old decode states)


def file_digest(folder: str) -> str:
    """sha256 over a checkpoint's config.json and weight files (not its host KV key factors, which
    no dense result reads): the key of its cached results."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name == "config.json" or (name.endswith(".safetensors") and name != KEY_FACTORS_FILE):
            with open(os.path.join(folder, name), "rb") as f:
                for chunk in iter(lambda: f.read(1 << 22), b""):
                    digest.update(chunk)
    return digest.hexdigest()


def same_base(a, b) -> bool:
    """Whether two models have equal weights apart from the eviction heads."""
    sa = {k: v for k, v in a.state_dict().items() if f".{MODULE_NAME}." not in k}
    sb = {k: v for k, v in b.state_dict().items() if f".{MODULE_NAME}." not in k}
    return sa.keys() == sb.keys() and all(sa[k].shape == sb[k].shape and sa[k].equal(sb[k]) for k in sa)


class DenseCache:
    """Dense results by (checkpoint digest, content key), in one JSON file per checkpoint."""

    def __init__(self, folder: str | None, model_digest: str):
        self.path = os.path.join(folder, f"dense-{model_digest[:16]}.json") if folder else None
        self.data = {}
        if self.path and os.path.isfile(self.path):
            with open(self.path) as f:
                self.data = json.load(f)

    def get(self, key: str):
        return self.data.get(key)

    def put(self, key: str, value) -> None:
        self.data[key] = value
        if self.path:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(self.path + ".tmp", "w") as f:
                json.dump(self.data, f)
            os.replace(self.path + ".tmp", self.path)


def context_kv(model, ids) -> DynamicCache:
    """Dense prefill of ids [T] with ``model``: its KV cache (every variant continues from a copy)."""
    with torch.no_grad():
        out = model(input_ids=ids[None], use_cache=True, logits_to_keep=1)
    return out.past_key_values


def cache_from(model, kv: DynamicCache | None) -> DynamicCache:
    """A copy of the context's cache ``kv`` (None: a new empty one); ``kv`` stays untouched. A copy
    of the whole object, not its tensors re-added: a sliding-window layer (Gemma 3) keeps only its
    window but counts every token seen, and the continuation's positions come from that count."""
    return DynamicCache(config=model.config) if kv is None else copy.deepcopy(kv)


def run_variant(variant: Variant, length: int, ex, kv, eos: int, settled) -> dict:
    """Greedy reply of one variant to one example, continuing from the context KV ``kv`` (None:
    prefill the whole prompt), and the selection statistics of its decode steps (sparse variants).
    Decoding stops at ``eos``, after ``ex.max_new_tokens`` tokens, or once ``settled(tokens)``
    (the reply is right whatever follows: more tokens cannot change its score)."""
    cfg = variant.prepare(length)
    start = ex.context_end if kv is not None else 0
    cache = cache_from(variant.model, kv)
    ids = torch.tensor(ex.prompt_ids[start:])[None]
    rows: dict[str, list] = {}
    tokens = []
    with torch.no_grad(), capture_attention_inputs(variant.model) if cfg else contextlib.nullcontext() as captured:
        out = variant.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        while True:
            for name, (q, _, _) in (captured or {}).items():
                rows.setdefault(name, []).append(q[-1:])
            tokens.append(int(out.logits[0, -1].argmax()))
            if tokens[-1] == eos or len(tokens) == ex.max_new_tokens or settled(tokens):
                break
            out = variant.model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
        final = dict(captured or {})
    result = {"tokens": tokens}
    if cfg is not None:
        result["select"] = decode_selection_stats(variant.model, rows, final, cfg)
    return result


def decode_selection_stats(model, rows: dict, final: dict, cfg) -> dict:
    """Sums over layers and KV heads for the decode rows q (one per step) of each layer: blocks
    entering between consecutive steps, step transitions, blocks selected after the first step,
    the largest entry count, and the dense mass inside the selection (sum over layers)."""
    stats = {"entering": 0, "transitions": 0, "selected": 0, "entering_max": 0, "mass": 0.0, "layers": 0}
    for name, qs in rows.items():
        q = torch.cat(qs)  # [n, Hq, D]: rows at positions L - n .. L - 1 of the final cache
        _, k, v = final[name]
        attn = model.get_submodule(name)
        with torch.no_grad():
            _, sel = nosa_prefill(q, k, v, getattr(attn, MODULE_NAME)(v), cfg, attn.scaling)  # [n, Hkv, K]
        positions = torch.arange(k.shape[0] - q.shape[0], k.shape[0])
        stats["mass"] += selection_mass(q, k, sel, positions, cfg, attn.scaling)
        stats["layers"] += 1
        if q.shape[0] > 1:
            enter = blocks_entering(sel[:-1], sel[1:])  # [n - 1, Hkv]
            stats["entering"] += int(enter.sum())
            stats["transitions"] += enter.numel()
            stats["selected"] += int((sel[1:] >= 0).sum())
            stats["entering_max"] = max(stats["entering_max"], int(enter.max()))
    return stats


def perplexity_nll(variant: Variant, length: int, window, tail: int, kv) -> float:
    """Mean next-token loss over the last ``tail`` tokens of ``window`` [length]; the first
    ``length - tail - 1`` tokens come from ``kv`` (dense prefill) or, with kv None, from the
    variant's own prefill."""
    variant.prepare(length)
    start = length - tail - 1 if kv is not None else 0
    with torch.no_grad():
        out = variant.model(input_ids=window[start:-1][None], past_key_values=cache_from(variant.model, kv),
                            use_cache=True, logits_to_keep=tail)
    return float(F.cross_entropy(out.logits[0].float(), window[-tail:]))
