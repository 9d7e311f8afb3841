"""Evaluation metrics: held-out loss and answer accuracy per synthetic task, and NOSA selection
statistics computed with the public functions of nosa (no second selection implementation).

Selection statistics of one sequence, per layer and KV head, from ``nosa_prefill``'s per-row
selections (row t selects as decode step t would):
- ``churn``: blocks entering the selection from row t-1 to row t (``blocks_entering``), over the
  rows whose context holds more than ``topk_blocks`` blocks; mean and max.
- ``mass``: share of the dense attention probability (softmax of q.k over all causal keys) that
  falls inside the selected blocks, averaged over query heads and sampled rows.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from nosa.attention.prefill import nosa_prefill
from nosa.config import NosaConfig
from nosa.eviction import MODULE_NAME
from nosa.hf import capture_attention_inputs
from nosa.select import blocks_entering, selection_mask
from nosa.train.data import IGNORE


@torch.no_grad()
def evaluate(model, rows, limit: int) -> dict[str, float]:
    """``eval/loss``, ``eval/acc`` (all answer tokens of a row right under teacher forcing, i.e.
    greedy decoding would reproduce them), ``eval/acc/<task>`` and ``eval/acc_token`` (the share
    of answer tokens right: each question of a multi-question example counted on its own)."""
    was_training = model.training
    model.eval()
    losses, right, tokens = [], defaultdict(list), []
    device = next(model.parameters()).device
    for i in range(min(limit, len(rows))):
        row = rows[i]
        ids = row["input_ids"][None].to(device)
        labels = row["labels"][None].to(device)
        docs = {}  # packed rows: each document attends only to itself (see nosa.train.data)
        if row.get("position_ids") is not None:
            docs = {"position_ids": torch.as_tensor(row["position_ids"])[None].to(device), "use_cache": False}
        out = model(input_ids=ids, labels=labels, **docs)
        losses.append(float(out.loss))
        target = labels[0, 1:]
        mask = target != IGNORE
        if mask.any():
            pred = out.logits[0, :-1].argmax(-1)
            hits = pred[mask] == target[mask]
            tokens += hits.tolist()
            ok = bool(hits.all())
            right[row["task"] or "text"].append(ok)
    model.train(was_training)
    result = {"eval/loss": sum(losses) / max(1, len(losses))}
    every = [x for v in right.values() for x in v]
    if every:
        result["eval/acc"] = sum(every) / len(every)
        result["eval/acc_token"] = sum(tokens) / len(tokens)
        for task, v in sorted(right.items()):
            result[f"eval/acc/{task}"] = sum(v) / len(v)
    return result


@torch.no_grad()
def selection_stats(
    model, input_ids: torch.Tensor, cfg: NosaConfig, mass_rows: int = 64, position_ids: torch.Tensor | None = None
) -> dict[str, float]:
    """Selection statistics of one sequence input_ids [L] (see the module docstring), per layer
    (``select/churn_mean/layerN`` ...) and averaged over layers (``select/churn_mean`` ...). With
    ``position_ids`` [L] of a packed row, only its first document counts (up to the first restart
    of the positions), so another document or the padding never enters the statistics."""
    if position_ids is not None:
        input_ids = first_document(input_ids, position_ids)
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    with capture_attention_inputs(model) as captured:
        model(input_ids=input_ids[None].to(device))
    model.train(was_training)
    out: dict[str, float] = {}
    per = defaultdict(list)
    for name, (q, k, v) in captured.items():
        attn = model.get_submodule(name)
        layer = int(name.split("layers.")[1].split(".")[0])
        stats = _layer_stats(q, k, v, getattr(attn, MODULE_NAME)(v), cfg, attn.scaling, mass_rows)
        for key, value in stats.items():
            out[f"select/{key}/layer{layer}"] = value
            per[key].append(value)
    for key, values in per.items():
        out[f"select/{key}"] = max(values) if key == "churn_max" else sum(values) / len(values)
    return out


def _layer_stats(q, k, v, cis, cfg: NosaConfig, scale: float, mass_rows: int) -> dict[str, float]:
    length = k.shape[0]
    _, sel = nosa_prefill(q, k, v, cis, cfg, scale)  # [L, Hkv, K]
    # Rows whose context has more blocks than the budget (earlier rows select everything).
    first = min(length - 1, cfg.topk_blocks * cfg.block_size + 1)
    first = max(first, cfg.dense_len + 1, 1)
    stats: dict[str, float] = {}
    if first < length:
        churn = blocks_entering(sel[first - 1 : -1], sel[first:]).float()  # [rows, Hkv]
        stats["churn_mean"] = float(churn.mean())
        stats["churn_max"] = float(churn.max())
    rows = torch.linspace(first, length - 1, steps=min(mass_rows, length - first)).long().unique()
    if rows.numel():
        stats["mass"] = selection_mass(q[rows], k, sel[rows], rows, cfg, scale)
    return stats


def dense_probs(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, scale: float) -> torch.Tensor:
    """The dense causal attention of query rows q [r, Hq, D] at ``positions`` [r] over k [L, Hkv, D]
    (GQA groups share a KV head): softmax of scale * q.k over keys at or before each row, float32
    [r, Hq, L]."""
    group = q.shape[1] // k.shape[1]
    logits = torch.einsum("rhd,lhd->rhl", q.float(), k.float().repeat_interleave(group, 1)) * scale
    causal = torch.arange(k.shape[0], device=q.device)[None, :] <= positions[:, None]
    return torch.softmax(logits.masked_fill(~causal[:, None, :], float("-inf")), dim=-1)


def selection_mass(q, k, sel, positions, cfg: NosaConfig, scale: float) -> float:
    """Mean share of the dense attention probability (``dense_probs``) inside the selected blocks,
    over rows and query heads. q [r, Hq, D] at ``positions`` [r]; k [L, Hkv, D]; sel [r, Hkv, K]."""
    length = k.shape[0]
    group = q.shape[1] // k.shape[1]
    inside = selection_mask(sel, cfg.num_blocks(length))  # [r, Hkv, NB]
    token_in = inside[..., torch.arange(length) // cfg.block_size].repeat_interleave(group, 1)  # [r, Hq, L]
    return float((dense_probs(q, k, positions, scale) * token_in).sum(-1).mean())


def first_document(input_ids: torch.Tensor, position_ids) -> torch.Tensor:
    """The first document of a packed row: input_ids [L] up to the first restart of position_ids."""
    restarts = (torch.as_tensor(position_ids)[1:] == 0).nonzero()
    return input_ids[: int(restarts[0]) + 1] if restarts.numel() else input_ids
