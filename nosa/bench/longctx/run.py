"""The long-context suite's run (scripts/bench_longctx.py): its variants loaded, every example
answered by every variant (dense replies cached), and perplexity on held-out windows."""

from __future__ import annotations

import hashlib
import os
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import nosa
from nosa import kv_calibrate, kvquant
from nosa.bench.longctx.config import PICKS, WINDOWS, windows_tag
from nosa.bench.longctx.suites import make_suite
from nosa.bench.longctx.summary import summarise
from nosa.bench.longctx.variant import (
    PPL_TAIL,
    DenseCache,
    Variant,
    context_kv,
    file_digest,
    perplexity_nll,
    run_variant,
    same_base,
)
from nosa.train import prose


def require_checkpoint(path: str, who: str) -> None:
    """Exit naming the command that writes the dense checkpoint when ``path`` holds none."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise SystemExit(f"{who}: no checkpoint at {path!r}; write it with "
                         f"`python -m nosa.models smollm2 --out {path}`")


def load_variants(args):
    """(variants, tokenizer, dense model digest)."""
    require_checkpoint(args.model, "bench_longctx")
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    dense = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa").eval()
    variants = [Variant("dense", dense, None, "dense")]
    host = [kvquant.host_kv_dtype(name, torch.float32) for name in getattr(args, "host_kv_dtypes", None) or ["auto"]]
    host = [None if not kvquant.is_quantized(d) else d for d in host]  # None: the model's dtype
    tag = {None: "", torch.int8: ", int8 host KV", torch.float8_e4m3fn: ", fp8 host KV"}
    windows = getattr(args, "windows", WINDOWS)
    layout = windows_tag(windows)  # other layouts, other names

    loaded: dict[str, dict | None] = {}

    def factors(path, d):  # an int8 pool's key factors, as a server loads them from the checkpoint (read once)
        if d != torch.int8:
            return None
        if path not in loaded:
            loaded[path] = kv_calibrate.load_key_factors(path)
        return loaded[path]

    def named(d, path):
        return tag[d] + (", key factors" if factors(path, d) is not None else "")

    variants += [Variant(f"A = 0, 1/{s}{layout}{named(d, args.model)}", dense, s, "dense", host_dtype=d,
                         key_factors=factors(args.model, d), windows=windows)
                 for s in args.shares if args.a0 for d in host]
    for spec in args.nosa or []:
        label, _, path = spec.rpartition("=")
        label = label or os.path.basename(os.path.normpath(path))
        model = nosa.from_pretrained(path).eval()
        base = "dense" if same_base(model, dense) else label
        variants += [Variant(f"{label}, 1/{s}" + (f", picks {p}" if args.picks != [PICKS] else "") + layout
                             + named(d, path), model, s, base, p, host_dtype=d, key_factors=factors(path, d),
                             windows=windows)
                     for s in args.shares for p in args.picks for d in host]
    for spec in getattr(args, "dense_ckpt", []):
        label, _, path = spec.rpartition("=")
        variants.append(Variant(label, nosa.from_pretrained(path).eval(), None, label))  # prepare(): sdpa
    return variants, tokenizer, file_digest(args.model)


def run(args, counts: dict[int, int]) -> dict:
    """The report (``summarise``) of every variant on ``counts[length]`` examples per task at each
    length, ``args`` as scripts/bench_longctx.py parses them."""
    from tqdm import tqdm  # optional: tqdm (the train extra)

    torch.manual_seed(0)
    t_start = time.perf_counter()
    variants, tokenizer, digest = load_variants(args)
    cache = DenseCache(args.cache or None, digest)
    _, heldout = prose.split(prose.documents(prose.FIXED_SOURCES))
    suite = make_suite(args.suite, args.tasks, data_dir=args.ruler_data)
    examples = [ex for length, n in counts.items()
                for ex in suite.examples(tokenizer, args.model, length, n, args.seed)]
    bases = {}  # base -> the model that prefills its contexts densely (the first variant's)
    for v in variants:
        bases.setdefault(v.base, v.model)
    records, seconds = [], {}
    bar = tqdm(examples, desc="examples", unit="ex", dynamic_ncols=True)
    for ex in bar:
        record = {"task": ex.task, "length": ex.length, "index": ex.index, "digest": ex.digest(),
                  "references": list(ex.references), "depths": list(ex.depths), "prompt_tokens": len(ex.prompt_ids),
                  "reply": {}, "right": {}, "select": {}}
        kvs = {}
        for variant in variants:
            key = reply_key(suite, ex)
            if variant.name == "dense" and cache.get(key):
                hit = cache.get(key)
                record["reply"][variant.name], record["right"][variant.name] = hit["reply"], hit["right"]
                continue
            t0 = time.perf_counter()
            kv = None
            if args.prefill == "dense":
                if variant.base not in kvs:
                    bases[variant.base].set_attn_implementation("sdpa")
                    kvs[variant.base] = context_kv(bases[variant.base], torch.tensor(ex.prompt_ids[: ex.context_end]))
                    seconds[("context prefill", ex.length)] = (seconds.get(("context prefill", ex.length), 0)
                                                               + time.perf_counter() - t0)
                    t0 = time.perf_counter()
                kv = kvs[variant.base]
            out, reply, right = answer(variant, ex, kv, tokenizer, suite)
            record["reply"][variant.name], record["right"][variant.name] = reply, right
            if "select" in out:
                record["select"][variant.name] = out["select"]
            if variant.name == "dense":  # the cache holds --model's results only
                cache.put(key, {"reply": reply, "right": right})
            seconds[(variant.name, ex.length)] = seconds.get((variant.name, ex.length), 0) + time.perf_counter() - t0
        records.append(record)
        bar.set_postfix_str(" ".join(f"{v.name.replace(' ', '')}={sum(r['right'].get(v.name, 0) for r in records):g}"
                                     for v in variants[:3]))
    perplexity = measure_perplexity(args, variants, tokenizer, heldout, cache, bases)
    return summarise(args, suite, counts, variants, records, perplexity, seconds,
                     env={"threads": torch.get_num_threads()},
                     seconds_total=time.perf_counter() - t_start)


def reply_key(suite, ex) -> str:
    """The dense cache's key of an example's reply (the nosa suite's keys predate RULER)."""
    return f"{'reply' if suite.name == 'nosa' else suite.name + '-reply'}:{ex.digest()}"


def answer(variant, ex, kv, tokenizer, suite) -> tuple[dict, str, float]:
    """(run_variant's result, the reply's text, its score) of one variant on one example."""
    out = run_variant(variant, ex.length, ex, kv, tokenizer.eos_token_id, lambda tokens: suite.settled(
        tokenizer.decode(tokens, skip_special_tokens=True), ex))
    reply = tokenizer.decode(out["tokens"], skip_special_tokens=True)
    return out, reply, suite.score(reply, ex)


def dense_answers(model_dir: str, tokenizer, suite, examples, cache_dir: str | None) -> list[dict]:
    """The dense model's ``{"reply", "right"}`` on each example as scripts/bench_longctx.py answers it
    (a dense context prefill, then greedy): from its dense cache under ``cache_dir`` when that holds
    the example, else computed now and put there."""
    require_checkpoint(model_dir, "dense answers")
    cache = DenseCache(cache_dir or None, file_digest(model_dir))
    dense, out = None, []
    for ex in examples:
        key = reply_key(suite, ex)
        hit = cache.get(key)
        if hit is None:
            if dense is None:
                model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="sdpa").eval()
                dense = Variant("dense", model, None, "dense")
            kv = context_kv(dense.model, torch.tensor(ex.prompt_ids[: ex.context_end]))
            _, reply, right = answer(dense, ex, kv, tokenizer, suite)
            hit = {"reply": reply, "right": right}
            cache.put(key, hit)
        out.append(hit)
    return out


def measure_perplexity(args, variants, tokenizer, heldout, cache, bases) -> list[dict]:
    """Per variant: mean loss over the last PPL_TAIL tokens (at most half a window) of ``--ppl-windows``
    consecutive held-out windows of the longest length (BOS, then the prose)."""
    from tqdm import tqdm  # optional: tqdm (the train extra)

    if args.ppl_windows == 0:
        return []
    length = max(args.lengths)
    tail = min(PPL_TAIL, length // 2)
    try:
        windows = prose.token_windows(tokenizer, heldout, length, args.ppl_windows)
    except ValueError as e:
        raise SystemExit(f"bench_longctx: {e}") from None
    nll = {v.name: [] for v in variants}
    for ids in tqdm(windows, desc=f"perplexity at {length}", unit="window", dynamic_ncols=True):
        window = torch.tensor(ids)
        key = f"ppl{tail}:" + hashlib.sha256(str(window.tolist()).encode()).hexdigest()
        kvs = {}
        for variant in variants:
            if variant.name == "dense" and cache.get(key) is not None:
                nll[variant.name].append(cache.get(key))
                continue
            kv = None
            if args.prefill == "dense":
                if variant.base not in kvs:
                    bases[variant.base].set_attn_implementation("sdpa")
                    kvs[variant.base] = context_kv(bases[variant.base], window[: length - tail - 1])
                kv = kvs[variant.base]
            value = perplexity_nll(variant, length, window, tail, kv)
            nll[variant.name].append(value)
            if variant.name == "dense":
                cache.put(key, value)
    return [{"variant": name, "length": length, "windows": len(v), "tokens": len(v) * tail,
             "nll": sum(v) / len(v), "share": next(x.share for x in variants if x.name == name)}
            for name, v in nll.items()]
