"""The ranking probe (scripts/probe_ranking.py): where a checkpoint's selection puts the block holding
the answer of the project's suite-style examples or NVIDIA RULER's, by the eviction heads' static
order and by the query-aware score, weighted by the dense attention the answer-predicting row pays
to it."""

from __future__ import annotations

import time

import torch
from transformers import AutoTokenizer

import nosa
from nosa.bench.longctx.config import budget_config
from nosa.bench.longctx.coverage import capture_examples, coverage, write_report
from nosa.bench.longctx.suites import make_suite
from nosa.compress import compress_windows
from nosa.eviction import MODULE_NAME, block_eviction_scores
from nosa.select import query_block_scores
from nosa.train import prose, ruler

# text of the inserted sentences (not of the instructions), to find the distractors' blocks: the
# project's suite (nosa.train.ruler) and RULER's needles ("One of the special magic numbers for ...")
INSERTED = {"nosa": ("magic numbers for", " keeps the ", "VAR ", "pass key is"), "ruler": ("special magic",)}


def static_order(evict) -> list[int]:
    """Blocks in the heads' order for one KV head: evict [NB, 2] (pooled score, block mean), best
    first, ties to the lower index (stable sorts, least significant key first)."""
    order = torch.arange(evict.shape[0])
    order = order[torch.sort(-evict[order, 1], stable=True).indices]
    return order[torch.sort(-evict[order, 0], stable=True).indices].tolist()


def probe(model, example: dict, share: int, inserted: set[int]) -> dict:
    """Answer-block weight of one example at one share: total, forced, ranked, picked, covered, and
    the weighted count of inserted-sentence blocks the heads rank above the answer's."""
    cfg = budget_config(example["length"], share)
    b, size = example["block"], cfg.block_size
    # every layer sees the same prompt: its blocks, the forced ones and the ranked slots are the example's
    length = next(iter(example["layers"].values()))[1].shape[0]
    nb, cur = cfg.num_blocks(length), (length - 1) // size
    forced = set(range(cfg.sink_blocks)) | set(range(max(0, cur - cfg.window_blocks + 1), cur + 1))
    ranked_slots = cfg.topk_blocks - len(forced) - cfg.query_blocks
    out = {"total": 0.0, "forced": 0.0, "ranked": 0.0, "picked": 0.0, "above": 0.0}
    for name, (q, k, v, probs) in example["layers"].items():
        attn = model.get_submodule(name)
        hkv = k.shape[1]
        with torch.no_grad():
            evict = block_eviction_scores(getattr(attn, MODULE_NAME)(v), cfg, nb)  # [Hkv, NB, 2]
            query = query_block_scores(q, compress_windows(k, cfg), torch.tensor([length - 1]), nb, cfg,
                                       attn.scaling)[0]  # [Hkv, NB]
        mass = probs[:, b * size : (b + 1) * size].sum(-1).reshape(hkv, -1).sum(-1)
        for h in range(hkv):
            m = float(mass[h])
            out["total"] += m
            if b in forced:
                out["forced"] += m
                continue
            by_heads = [x for x in static_order(evict[h]) if x not in forced]
            by_query = [x for x in torch.sort(-query[h], stable=True).indices.tolist() if x not in forced]
            rank = by_heads.index(b)
            out["ranked"] += m * (rank < ranked_slots)
            out["picked"] += m * (b in by_query[: cfg.query_blocks])
            out["above"] += m * len(inserted.intersection(by_heads[:rank]))
    out["covered"] = coverage(model, example, share) * out["total"]
    return out


def run(args) -> int:
    """The probe of ``args`` (as scripts/probe_ranking.py parses them): the report written to
    ``args.out`` and its markdown table printed; returns 0."""
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    model = nosa.from_pretrained(args.checkpoint).eval()
    if args.suite == "ruler":  # RULER's own examples (the benchmark's, at its seed)
        examples = make_suite("ruler", args.tasks, data_dir=args.ruler_data).examples(
            tokenizer, args.tokenizer, args.length, args.examples, args.seed)
    else:
        _, heldout = prose.split(prose.documents(prose.FIXED_SOURCES))
        haystack = ruler.Haystack(tokenizer, [d.text for d in heldout])
        examples = [ex for task in args.tasks
                    for ex in ruler.make_examples(tokenizer, haystack, task, args.length, args.examples, args.seed)]
    capture_cfg = budget_config(args.length, args.shares[0])  # the capture runs densely; any share's blocks
    size = capture_cfg.block_size
    captured = capture_examples(model, capture_cfg, examples, tokenizer, size)
    by_index = {(ex.task, ex.index): ex for ex in examples}
    sums: dict[tuple[str, int], dict] = {}
    per_example = []
    for cap in captured:
        ex = by_index[(cap["task"], cap["index"])]
        texts = [tokenizer.decode(list(ex.prompt_ids[i : i + size])) for i in range(0, ex.context_end, size)]
        inserted = {i for i, t in enumerate(texts) if any(s in t for s in INSERTED[args.suite])} - {cap["block"]}
        for share in args.shares:
            got = probe(model, cap, share, inserted)
            total = got["total"] or float("nan")
            per_example.append({"task": cap["task"], "index": cap["index"], "share": share, "block": cap["block"],
                                **{key: got[key] / total for key in ("forced", "ranked", "picked", "covered")},
                                "above": got["above"] / total})
            acc = sums.setdefault((cap["task"], share), {"examples": 0})
            acc["examples"] += 1
            for key, value in got.items():
                acc[key] = acc.get(key, 0.0) + value
    rows = []
    for (task, share), acc in sums.items():
        total = acc["total"]
        rows.append({"task": task, "share": share, "examples": acc["examples"],
                     "config": budget_config(args.length, share).to_dict(),
                     **{key: acc[key] / total for key in ("forced", "ranked", "picked", "covered", "above")}})
    report = {"checkpoint": args.checkpoint, "suite": args.suite, "length": args.length, "seed": args.seed,
              "tasks": args.tasks, "examples_per_task": args.examples, "rows": rows, "examples": per_example,
              "seconds": round(time.perf_counter() - t0, 1),
              "metric": "shares of the answer block's dense attention from the last prompt row (module docstring)"}
    write_report(report, args.out)
    print("| task | budget | ranked by the heads | picked by the query | forced | in the selection "
          "| inserted sentences ranked above it |\n|---|---|---|---|---|---|---|")
    for r in rows:
        c = r["config"]
        print(f"| {r['task']} | 1/{r['share']} ({c['topk_blocks']}: {c['query_blocks']} picks) | {r['ranked']:.3f} "
              f"| {r['picked']:.3f} | {r['forced']:.3f} | {r['covered']:.3f} | {r['above']:.2f} |")
    print(f"\nwrote {args.out} ({report['seconds'] / 60:.1f} min)")
    return 0
