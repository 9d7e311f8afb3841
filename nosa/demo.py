"""The core demo: a tiny Llama built from a config, dense vs NOSA, and what the selection does per
decode step. Run ``python -m nosa.demo --help``.

1. Equivalence: NOSA with a budget covering every block and A = 0 gives the dense model's logits.
2. Sparsity: with a budget of ``--topk-blocks`` blocks (a fraction of the context), how close the
   sparse model's next-token distribution stays to the dense one. The model has random weights:
   the figures measure what the selection changes, not accuracy (it prints what each one means).
3. Decode: greedy ``generate`` through the decode path; per step, the selected blocks of layer 0 /
   KV head 0 and the blocks that entered the selection (max over layers and heads), against the
   locality bound ``query_blocks + 1``.
Writes everything to a JSON file (default results/demo.json).
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import time

import torch

import nosa
from nosa.bench.results import write_result
from nosa.config import NosaConfig
from nosa.tiny import set_eviction_heads, tiny_llama


def build_model(seed: int, layers: int, hidden: int):
    """The demo's dense model: a tiny Llama (GQA 8/2, vocabulary 512) from nosa.tiny, in eval mode."""
    return tiny_llama(layers=layers, hidden=hidden, heads=8, kv_heads=2, vocab=512, seed=seed,
                      max_positions=65536, pad_token_id=0, bos_token_id=1, eos_token_id=2).eval()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m nosa.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=2048, help="prompt length in tokens (default 2048)")
    parser.add_argument("--new-tokens", type=int, default=48, help="greedy decode steps (default 48)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16)")
    parser.add_argument("--topk-blocks", type=int, default=16, help="budget in blocks (default 16)")
    parser.add_argument("--query-blocks", type=int, default=4, help="free query-aware picks (default 4)")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="results/demo.json", help="JSON output (default results/demo.json)")
    args = parser.parse_args(argv)

    cfg = NosaConfig(block_size=args.block_size, compress_kernel=args.block_size // 2,
                     compress_stride=args.block_size // 4, sink_blocks=1, window_blocks=4,
                     topk_blocks=args.topk_blocks, query_blocks=args.query_blocks, dense_len=0)
    blocks = cfg.num_blocks(args.context)
    print(f"[demo] tiny Llama: {args.layers} layers, hidden {args.hidden}, GQA 8/2; context {args.context} "
          f"tokens = {blocks} blocks of {cfg.block_size}")
    print(f"[demo] {cfg}")
    dense = build_model(args.seed, args.layers, args.hidden)
    prompt = torch.randint(3, 512, (1, args.context), generator=torch.Generator().manual_seed(args.seed))

    with torch.no_grad():
        t0 = time.perf_counter()
        dense_logits = dense(prompt).logits[0]
        t_dense = time.perf_counter() - t0
        full = nosa.convert(copy.deepcopy(dense), NosaConfig(**{**cfg.to_dict(), "topk_blocks": blocks + 1,
                                                                  "query_blocks": 0}))
        full_err = (full(prompt).logits[0] - dense_logits).abs().max().item()
        sparse = nosa.convert(copy.deepcopy(dense), cfg)
        set_eviction_heads(sparse, scale=1.0, std=0.3, seed=args.seed)  # stand-in for fitted heads
        t0 = time.perf_counter()
        sparse_logits = sparse(prompt).logits[0]
        t_sparse = time.perf_counter() - t0
    late = slice(cfg.topk_blocks * cfg.block_size, None)  # rows whose context exceeds the budget
    p_dense = torch.log_softmax(dense_logits[late], -1)
    p_sparse = torch.log_softmax(sparse_logits[late], -1)
    kl = torch.sum(p_dense.exp() * (p_dense - p_sparse), -1).mean().item()
    top1 = (p_dense.argmax(-1) == p_sparse.argmax(-1)).float().mean().item()
    entropy = -(p_dense.exp() * p_dense).sum(-1).mean().item()  # of the dense next-token distribution
    vocab = dense_logits.shape[-1]
    print(f"[demo] full budget, A=0 vs dense: max |logit diff| = {full_err:.2e} (the same model: rounding only)")
    print(f"[demo] budget {cfg.topk_blocks}/{blocks} blocks ({cfg.topk_blocks / blocks:.0%}), stand-in "
          f"eviction heads (random W, A = 1): KL(dense||nosa) = {kl:.4f} nats, top-1 agreement {top1:.1%} "
          f"(prefill {t_dense:.2f}s dense, {t_sparse:.2f}s nosa reference)")
    print(f"[demo]   what these mean: the model has random weights, so its next-token distribution is nearly "
          f"flat (entropy {entropy:.2f} of at most {math.log(vocab):.2f} nats). KL measures how far attending to "
          f"{cfg.topk_blocks / blocks:.0%} of the blocks moves it; top-1 agreement only says how often two nearly "
          f"flat distributions break their near-ties alike (chance: {1 / vocab:.1%}), not answer quality. A "
          "trained model's accuracy under NOSA: scripts/bench_accuracy.py.")

    steps = []
    attn_modules = [m for n, m in sparse.named_modules() if n.endswith("self_attn")]

    def record(_module, _inputs, _output):
        states = [m._nosa_states[0] for m in attn_modules if m.__dict__.get("_nosa_states")]
        if len(states) != len(attn_modules) or states[-1].length != states[0].length:
            return
        entering = [int(s.entering.max()) for s in states if s.entering is not None]
        steps.append({"length": states[0].length, "layer0_head0": states[0].selection[0].tolist(),
                      "entering_max": max(entering) if entering else None})

    hook = attn_modules[-1].register_forward_hook(record)
    out = sparse.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=args.new_tokens,
                          min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
    hook.remove()
    bound = cfg.max_blocks_entering_per_step
    print(f"[demo] decode: {len(steps)} steps; blocks entering per step (max over layers and KV heads), "
          f"bound query_blocks + 1 = {bound}")
    for s in steps[:: max(1, len(steps) // 12)]:
        print(f"  len {s['length']:>6}  entering {s['entering_max']!s:>4}  layer0/head0 {s['layer0_head0']}")
    churn = [s["entering_max"] for s in steps if s["entering_max"] is not None]
    result = {
        "config": cfg.to_dict(), "context": args.context, "num_blocks": blocks,
        "full_budget_max_abs_logit_diff": full_err, "sparse_kl_nats": kl, "sparse_top1_agreement": top1,
        "decode_steps": steps, "entering_mean": sum(churn) / max(len(churn), 1),
        "entering_max": max(churn, default=0), "locality_bound": bound,
        "generated": out[0, args.context:].tolist(),
    }
    print(f"[demo] churn: mean {result['entering_mean']:.2f}, max {result['entering_max']} blocks per step "
          f"(bound {bound}, budget {cfg.topk_blocks})")
    if result["entering_max"] > bound:
        raise SystemExit(f"locality bound violated: {result['entering_max']} > {bound}")
    write_result(args.out, result, argv=["-m", "nosa.demo", *(sys.argv[1:] if argv is None else argv)])
    print(f"[demo] wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
