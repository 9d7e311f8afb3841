"""Fit the eviction heads to the dense model's attention before the NOSA fine-tune (optional:
``distill.rows`` > 0; the settings are TrainConfig's ``distill`` section).

Why: right after conversion every head is off (A = 0) and gets a gradient only through blocks
already selected, so a fact block the query-aware scores miss never teaches its head to keep it.
Target of token j and KV head h: the largest dense attention probability any query head of h's
group gives j from a row t whose local window does not cover j, each row weighed as the training
loss weighs it (nosa.train.loss.row_weights). The logit ``W v_j + b`` is fitted to it by balanced
soft-label BCE on inputs captured once; then A is set to ``distill.scale``. Optionally
(``distill.rank_weight`` > 0) a listwise term fits the window means the selection ranks
(``WindowRank``).
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

import nosa
from nosa.compress import compress_windows
from nosa.config import NosaConfig
from nosa.eviction import MODULE_NAME
from nosa.hf import capture_attention_inputs
from nosa.layout import NEG_INF
from nosa.train.config import DistillSection
from nosa.train.loss import row_weights
from nosa.train.metrics import dense_probs, first_document


@torch.no_grad()
def attention_targets(q, k, cfg: NosaConfig, scale: float, weight: torch.Tensor | None = None, chunk: int = 256):
    """q [L, Hq, D], k [L, Hkv, D], weight [L] (row t's weight, default 1) -> (target [L, Hkv] in
    [0, 1], valid [L, Hkv] bool). Only rows of positive weight are computed, ``chunk`` at a time:
    with answer-only labels that is a few rows of a long row, and the [rows, Hq, L] probabilities of
    every row of an 8K row would not fit in memory."""
    length, hq, _ = q.shape
    hkv = k.shape[1]
    pos = torch.arange(length)
    weight = torch.ones(length) if weight is None else weight.float().cpu()
    weight = weight / weight.max().clamp(min=1e-12)
    target = torch.zeros(hkv, hq // hkv, length)
    seen = torch.zeros(length, dtype=torch.bool)
    rows = (weight > 0).nonzero().squeeze(1)
    for start in range(0, len(rows), chunk):
        t = rows[start : start + chunk]
        far = (t[:, None] // cfg.block_size - pos[None, :] // cfg.block_size) >= cfg.window_blocks  # [t, j]
        probs = dense_probs(q[t], k, t, scale).masked_fill(~far[:, None, :], 0.0) * weight[t, None, None]
        target = torch.maximum(target, probs.amax(dim=0).reshape(hkv, hq // hkv, length))
        seen |= far.any(dim=0)
    valid = seen & (pos >= cfg.sink_blocks * cfg.block_size)
    return target.amax(dim=1).transpose(0, 1), valid[:, None].expand(length, hkv)


def fit_eviction_heads(
    model, rows, cfg: NosaConfig, distill: DistillSection, answer_weight: float = 1.0, print0=print,
    progress: bool = False,
) -> dict:
    """Fit W, b of every eviction head of the converted ``model`` on ``rows`` (packed training rows
    with labels and answers, first document of each; rows weighed as the loss weighs them) with the
    ``distill`` settings, then set every A to ``distill.scale``; ``progress``: progress bars over
    the rows and the layers. Returns {"distill/loss_first", "distill/loss", "distill/seconds"}."""
    t0 = time.perf_counter()
    data = capture_fit_inputs(model, rows, cfg, answer_weight, progress)
    first, last = fit_heads(model, data, cfg, distill, progress)
    seconds = time.perf_counter() - t0
    print0(f"eviction heads fitted to the dense attention: loss {first:.4f} -> {last:.4f} "
           f"({distill.steps} steps, {len(rows)} rows, {seconds:.0f} s); A = {distill.scale}")
    return {"distill/loss_first": first, "distill/loss": last, "distill/seconds": seconds}


def capture_fit_inputs(model, rows, cfg: NosaConfig, answer_weight: float = 1.0, progress: bool = False) -> dict:
    """What the fit reads, per attention module name: a list over ``rows`` of (v [L, Hkv, D],
    target [L, Hkv], valid [L, Hkv]) on the CPU (``attention_targets`` of the dense attention)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    data: dict[str, list] = {}
    # the targets are the dense model's attention: every layer runs densely while its inputs are
    # captured (A is still 0 and every row is within dense_len), so later layers see dense inputs
    nosa.convert(model, dataclasses.replace(cfg, dense_len=max(len(row["input_ids"]) for row in rows)))
    with torch.no_grad():
        for row in tqdm(rows, desc="fit: dense attention", unit="row", disable=not progress, dynamic_ncols=True):
            ids = first_document(row["input_ids"], row["position_ids"])
            weight = None  # rows without labels (plain ids): every row counts
            if "labels" in row:
                weight = row_weights(row["labels"], row["answers"], answer_weight)[: len(ids)]
            with capture_attention_inputs(model) as captured:
                # only the attention inputs are read: the LM head runs on one row, not all of them
                model(input_ids=ids[None].to(device), logits_to_keep=1)
            for name, (q, k, v) in captured.items():
                attn = model.get_submodule(name)
                target, valid = attention_targets(q.cpu(), k.cpu(), cfg, attn.scaling, weight)
                data.setdefault(name, []).append((v.cpu(), target, valid))
    nosa.convert(model, cfg)
    model.train(was_training)
    return data


def fit_heads(model, data: dict, cfg: NosaConfig, distill: DistillSection,
              progress: bool = False) -> tuple[float, float]:
    """Fit every eviction head of ``model`` on ``capture_fit_inputs``'s ``data`` (from W, b as they
    are; ``distill.steps`` at ``distill.lr``, the ranking term at ``distill.rank_weight``) and set
    its A to ``distill.scale``. Returns the token loss before and after, averaged over layers."""
    first = last = 0.0
    for name, items in tqdm(data.items(), desc="fit: heads", unit="layer", disable=not progress, dynamic_ncols=True):
        head = getattr(model.get_submodule(name), MODULE_NAME)
        v, target, valid = (torch.cat([x[i] for x in items]) for i in range(3))
        rank = (WindowRank([x[0].shape[0] for x in items], cfg, distill.rank_weight, distill.rank_tau)
                if distill.rank_weight > 0 else None)
        a, b = fit_head(head, v, target, valid, distill.steps, distill.lr, rank=rank)
        first, last = first + a / len(data), last + b / len(data)
        with torch.no_grad():
            head.scale.fill_(distill.scale)
    return first, last


def fit_head(head, v, target, valid, steps: int, lr: float, batch: int = 2048, seed: int = 0,
             rank: WindowRank | None = None) -> tuple[float, float]:
    """Fit ``head.proj`` (W, b) so that sigmoid(W v + b) matches ``target`` where ``valid``:
    ``steps`` Adam steps on ``batch`` tokens each, drawn (with replacement) with probability
    proportional to their weight in ``balanced_bce``, whose loss each step's mean estimates without
    bias. Full-batch steps over tens of thousands of tokens cost about 50 ms each on a CPU (the
    weight gradient's skinny matmul), 30 layers of them minutes; sampling by weight keeps the few
    attended tokens in every batch. v [N, Hkv, D]; target, valid [N, Hkv]. Returns the full loss
    before and after."""
    x = v.to(head.proj.weight).flatten(-2).contiguous()  # [N, Hkv * D]
    target, valid = target.to(x), valid.to(x.device)
    weight = balanced_weights(target, valid)  # [N, Hkv]
    target = target.masked_fill(~valid, 0.0)
    token_weight = weight.sum(-1)  # [N]
    gen = torch.Generator(device=x.device).manual_seed(seed)
    opt = torch.optim.Adam(head.proj.parameters(), lr=lr)
    with torch.no_grad():
        first = float(balanced_bce(head.proj(x), target, valid))
    for _ in range(steps):
        idx = torch.multinomial(token_weight, batch, replacement=True, generator=gen)
        bce = F.binary_cross_entropy_with_logits(head.proj(x[idx]), target[idx], reduction="none")
        loss = ((bce * weight[idx]).sum(-1) / token_weight[idx]).mean()
        if rank is not None and rank.rank_weight > 0:
            loss = loss + rank.rank_weight * rank.loss(head.proj, x, target, valid, gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        final = float(balanced_bce(head.proj(x), target, valid))
    return first, final


@dataclasses.dataclass
class WindowRank:
    """A listwise ranking term for ``fit_head``: the static part of the selection ranks blocks by
    the mean of cis over compressed windows (nosa.eviction.block_eviction_scores), so this fits the
    order of those means to the attention each window receives. Per row (document) and KV head, the
    cross-entropy between the windows' share of the target mass and softmax(window mean of
    softplus(W v + b) / rank_tau), over the windows whose every token has a target. The token loss
    alone fits the few attended tokens (a digit, a name) and the punctuation that draws attention
    everywhere, and the window mean dilutes a lone attended token among 31 others; this term scores
    the window as the selection does. ``lengths``: the tokens of each row, in the order the rows
    were concatenated; ``rows_per_step`` rows are drawn per step."""

    lengths: list[int]
    cfg: NosaConfig
    rank_weight: float = 1.0  # distill.rank_weight: the term's weight beside the token loss
    rank_tau: float = 0.02  # distill.rank_tau: the softmax temperature
    rows_per_step: int = 4

    def __post_init__(self):
        self.starts = [0]
        for n in self.lengths[:-1]:
            self.starts.append(self.starts[-1] + n)

    def loss(self, proj, x, target, valid, gen) -> torch.Tensor:
        pick = torch.randint(len(self.lengths), (self.rows_per_step,), generator=gen, device=x.device)
        total, count = x.new_zeros(()), 0
        for r in pick.tolist():
            rows = slice(self.starts[r], self.starts[r] + self.lengths[r])
            score = compress_windows(F.softplus(proj(x[rows])), self.cfg)  # [C, Hkv]
            whole = compress_windows(valid[rows].to(x.dtype), self.cfg) == 1  # every token has a target
            mass = compress_windows(target[rows], self.cfg).masked_fill(~whole, 0.0)
            live = mass.sum(0) > 0  # [Hkv]: heads whose answer rows attend somewhere in this row
            if not live.any():
                continue
            share = mass / mass.sum(0).clamp(min=1e-12)
            logp = torch.log_softmax((score / self.rank_tau).masked_fill(~whole, NEG_INF), dim=0)
            total = total - (share * logp.masked_fill(~whole, 0.0)).sum(0)[live].sum()
            count += int(live.sum())
        return total / max(count, 1)


def balanced_weights(target, valid):
    """Token j of head h weighs ``1 + target * n_h / sum(target_h)`` where ``valid`` (0 elsewhere):
    the attended tokens of a head together weigh as much as all of its tokens. Few tokens are
    attended from far away (4 facts among ~500 tokens in the tiny task), and a plain mean let the
    fit rank some facts below filler (measured: docs/training.md). target, valid [N, Hkv] -> [N, Hkv]."""
    target = target.masked_fill(~valid, 0.0)
    boost = valid.sum(0) / target.sum(0).clamp(min=1e-6)  # [Hkv]
    return valid * (1 + target * boost)


def balanced_bce(logit, target, valid):
    """Binary cross-entropy with soft labels, weighed by ``balanced_weights``, a scalar."""
    weight = balanced_weights(target, valid)
    loss = F.binary_cross_entropy_with_logits(logit, target.masked_fill(~valid, 0.0), reduction="none")
    return (loss * weight).sum() / weight.sum().clamp(min=1e-6)
