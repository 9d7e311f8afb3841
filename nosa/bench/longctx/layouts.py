"""The windows probe (scripts/probe_windows.py): which compressed-window layout lets the query-aware
score find the block the dense attention reads. For each (kernel, stride) layout, on the dense model's
attention inputs of the last prompt row, the candidate blocks (neither sink nor window) are ranked by
``nosa.select.query_block_scores`` with that layout, as the selection's free picks are. Two figures per
layout, over examples, layers and KV heads:

- ``top1``, ``top2``, ``top4``: the share of the answer block's dense attention that falls on the
  answer block when it is among the top 1, 2 or 4 blocks (the answer block is where the first
  reference first appears, as in the ranking probe; weighted by the attention the row pays it);
- ``best``: how often the top block is the candidate block the dense attention weighs most.

Beside the layouts, ``token max`` ranks blocks by their best single key (the softmax over blocks of the
largest q . k in each, summed over the group): the ceiling a score that sees every key would reach,
which an offloaded cache cannot compute (its keys are on the host)."""

from __future__ import annotations

import dataclasses
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from nosa.bench.longctx.config import budget_config, windows_name
from nosa.bench.longctx.coverage import capture_examples, write_report
from nosa.bench.longctx.suites import make_suite
from nosa.compress import compress_windows
from nosa.select import forced_blocks, query_block_scores

TOKEN_MAX = "token max"


def token_max_scores(q: torch.Tensor, k: torch.Tensor, num_blocks: int, block: int, scale: float) -> torch.Tensor:
    """[Hkv, NB]: per KV head, the group-summed softmax over blocks of each block's largest q . k.
    q: [1, Hq, D] (the last row); k: [L, Hkv, D]."""
    length, hkv, d = k.shape
    group = q.shape[1] // hkv
    logits = torch.einsum("hgd,lhd->hgl", q[0].float().reshape(hkv, group, d), k.float()) * scale
    padded = torch.nn.functional.pad(logits, (0, num_blocks * block - length), value=float("-inf"))
    return torch.softmax(padded.reshape(hkv, group, num_blocks, block).amax(-1), dim=-1).sum(1)


def layout_scores(q: torch.Tensor, k: torch.Tensor, cfg, scale: float) -> torch.Tensor:
    """[Hkv, NB]: the selection's query-aware block scores of the last row with ``cfg``'s windows."""
    length = k.shape[0]
    return query_block_scores(q, compress_windows(k, cfg), torch.tensor([length - 1]), cfg.num_blocks(length),
                              cfg, scale)[0]


def probe_layouts(captured: list[dict], cfg, layouts: list[tuple[int, int]], scaling: dict[str, float]) -> dict:
    """Sums per layout name: weight, top1/top2/top4 (weighted), best and heads (counts)."""
    sums = {name: dict.fromkeys(("weight", "top1", "top2", "top4", "best", "heads"), 0.0)
            for name in [windows_name(w) for w in layouts] + [TOKEN_MAX]}
    size = cfg.block_size
    for cap in captured:
        b = cap["block"]
        for name, (q, k, _, probs) in cap["layers"].items():
            length, hkv = k.shape[0], k.shape[1]
            nb = cfg.num_blocks(length)
            exists, forced = forced_blocks(torch.tensor([length - 1]), nb, cfg)
            cand = (exists & ~forced)[0]
            if not cand[b]:
                continue
            padded = torch.nn.functional.pad(probs, (0, nb * size - probs.shape[1]))
            mass = padded.reshape(hkv, -1, nb, size).sum((1, 3))  # [Hkv, NB], the group's attention per block
            scores = {windows_name(w): layout_scores(q, k, dataclasses.replace(cfg, compress_kernel=w[0],
                                                                               compress_stride=w[1]), scaling[name])
                      for w in layouts}
            scores[TOKEN_MAX] = token_max_scores(q, k, nb, size, scaling[name])
            for layout, score in scores.items():
                acc = sums[layout]
                for h in range(hkv):
                    weight = float(mass[h, b])
                    order = torch.sort(-score[h].masked_fill(~cand, float("-inf")), stable=True).indices.tolist()
                    acc["weight"] += weight
                    acc["heads"] += 1
                    for n in (1, 2, 4):
                        acc[f"top{n}"] += weight * (b in order[:n])
                    acc["best"] += order[0] == int(mass[h].masked_fill(~cand, -1.0).argmax())
    return sums


def run(args) -> int:
    """The probe of ``args`` (as scripts/probe_windows.py parses them): JSON to ``args.out``, a markdown
    table printed; returns 0."""
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation="sdpa").eval()
    examples = make_suite("ruler", args.tasks, data_dir=args.ruler_data).examples(
        tokenizer, args.model, args.length, args.examples, args.seed)
    cfg = budget_config(args.length, args.share)
    captured = capture_examples(model, cfg, examples, tokenizer, cfg.block_size)
    scaling = {name: model.get_submodule(name).scaling for name in captured[0]["layers"]} if captured else {}
    sums = probe_layouts(captured, cfg, args.windows, scaling)
    per_block = {windows_name(w): cfg.block_size / w[1] for w in args.windows}  # token max: None
    rows = [{"layout": name, "windows_per_block": per_block.get(name),
             **{key: acc[key] / acc["weight"] for key in ("top1", "top2", "top4")}, "best": acc["best"] / acc["heads"]}
            for name, acc in sums.items()]
    report = {"model": args.model, "suite": "ruler", "length": args.length, "share": args.share, "seed": args.seed,
              "tasks": args.tasks, "examples_per_task": args.examples, "examples": len(captured),
              "heads": int(next(iter(sums.values()))["heads"]), "config": cfg.to_dict(), "rows": rows,
              "seconds": round(time.perf_counter() - t0, 1),
              "metric": "answer block's dense attention caught by the top 1/2/4 query-ranked candidate blocks; "
                        "best: top block = the candidate the dense attention weighs most (module docstring)"}
    write_report(report, args.out)
    print("| windows (kernel/stride) | top 1 | top 2 | top 4 | top block = dense's best |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layout']} | {r['top1']:.3f} | {r['top2']:.3f} | {r['top4']:.3f} | {r['best']:.3f} |")
    print(f"\nwrote {args.out} ({report['seconds'] / 60:.1f} min)")
    return 0
