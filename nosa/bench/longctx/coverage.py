"""Answer-block coverage (scripts/sweep_fit.py, scripts/probe_ranking.py): suite-style examples run
densely, the answer's block found in the context, and the share of the dense attention the
answer-predicting row pays to that block that falls inside a model's selection."""

from __future__ import annotations

import dataclasses

import torch

import nosa
from nosa import nosa_prefill
from nosa.bench.longctx.config import budget_config
from nosa.bench.results import write_result
from nosa.eviction import MODULE_NAME
from nosa.hf import capture_attention_inputs
from nosa.train.metrics import dense_probs


def answer_block(tokenizer, ex, block_size: int) -> int | None:
    """The block of the first context token of the example's first reference (None if not found)."""
    ids = list(ex.prompt_ids[: ex.context_end])
    for text in (" " + ex.references[0], ex.references[0]):
        sub = tokenizer(text, add_special_tokens=False)["input_ids"]
        for i in range(len(ids) - len(sub) + 1):
            if ids[i : i + len(sub)] == sub:
                return i // block_size
    return None


def write_report(report: dict, out: str) -> None:
    """``report`` with the torch threads added, written to ``out`` (``write_result``: with provenance)."""
    report["env"] = {"threads": torch.get_num_threads()}
    write_result(out, report)


def capture_examples(model, fit_cfg, examples, tokenizer, block_size: int) -> list[dict]:
    """Per example: the answer block, and per layer the last prompt row's q, the keys and values,
    and the dense attention probabilities of that row (the model runs densely)."""
    from tqdm import tqdm  # optional: tqdm (the train extra)

    out = []
    nosa.convert(model, dataclasses.replace(fit_cfg, dense_len=max(len(ex.prompt_ids) for ex in examples)))
    for ex in tqdm(examples, desc="dense passes", unit="example"):
        block = answer_block(tokenizer, ex, block_size)
        if block is None:
            print(f"sweep_fit: {ex.task} example {ex.index} at {ex.length}: answer not found in the context; skipped")
            continue
        ids = torch.tensor(ex.prompt_ids)
        with torch.no_grad(), capture_attention_inputs(model) as captured:
            model(input_ids=ids[None], logits_to_keep=1)
        layers = {}
        for name, (q, k, v) in captured.items():
            probs = dense_probs(q[-1:], k, torch.tensor([len(ids) - 1]), model.get_submodule(name).scaling)[0]
            layers[name] = (q[-1:], k, v, probs)  # probs [Hq, L]
        out.append({"task": ex.task, "length": ex.length, "index": ex.index, "block": block, "layers": layers})
    nosa.convert(model, fit_cfg)
    return out


def coverage(model, example: dict, share: int) -> float:
    """Share of the answer block's dense attention (last prompt row, all layers and KV heads) that
    falls inside the selection of the model's eviction heads at the suite's config."""
    cfg = budget_config(example["length"], share)
    b, size = example["block"], cfg.block_size
    total = inside = 0.0
    for name, (q, k, v, probs) in example["layers"].items():
        attn = model.get_submodule(name)
        with torch.no_grad():
            _, sel = nosa_prefill(q, k, v, getattr(attn, MODULE_NAME)(v), cfg, attn.scaling)  # [1, Hkv, K]
        hkv = sel.shape[1]
        mass = probs[:, b * size : (b + 1) * size].sum(-1).reshape(hkv, -1).sum(-1)  # [Hkv]
        chosen = (sel[0] == b).any(-1)
        total += float(mass.sum())
        inside += float(mass[chosen].sum())
    return inside / total if total > 0 else float("nan")
