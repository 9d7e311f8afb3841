"""The selection loss (``data.select_weight``): teaches the query-aware score where the dense
attention looks.

At a query row at position t the selection (nosa.select) scores every block with
``query_block_scores``: the softmax of q over the compressed keys, summed over the KV head's query
heads, max-pooled onto blocks. The free picks (and, for a head with A = 0, the whole budget) take
the best of the *candidate* blocks, those that exist and are not forced (``forced_blocks``: sinks
and the local window). The training-free score often misses the block that holds the asked needle
(docs/ruler.md). This loss is, per row and KV head,

    KL(target || score) over the candidate blocks, both normalised to sum to 1,

- target: the dense attention probability that the head's query heads give each block (softmax of
  q . k over every causal key of the document, summed over the block's tokens, averaged over the
  group), without gradient;
- score: the query-aware block scores, with gradient into q and, through the compressed keys
  (window means), into k.

The peer is DeepSeek V3.2's DSA indexer, warmed up with KL(main attention || indexer). Here the
indexer is the model's own q and compressed keys (InfLLM-v2's score), so what is trained is what
the server selects with, by the one implementation both run; the KL to the frozen model's logits
(``data.kl_weight``) holds the attention output. Rows: the answer tokens first (where the needle
must be selected), then other labelled rows, at most ``data.select_rows`` per micro batch, only
rows that have candidates.
"""

from __future__ import annotations

import torch

from nosa.compress import compress_windows
from nosa.config import NosaConfig
from nosa.select import forced_blocks, query_block_scores
from nosa.train.loss import row_weights

EPS = 1e-8


def dense_block_mass(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, num_blocks: int,
                     cfg: NosaConfig, scale: float) -> torch.Tensor:
    """The dense attention probability per block: q [R, Hq, D] at ``positions`` [R] (causal over
    k [L, Hkv, D], L >= max position + 1) -> [R, Hkv, NB] float32, averaged over each KV head's
    query heads; every row sums to 1. No gradient."""
    rows, hq, d = q.shape
    length, hkv, _ = k.shape
    with torch.no_grad():
        qg = q.detach().float().view(rows, hkv, hq // hkv, d)
        logits = torch.einsum("rhgd,lhd->rhgl", qg, k.detach().float()) * scale
        future = torch.arange(length, device=q.device)[None, :] > positions[:, None]  # [R, L]
        probs = torch.softmax(logits.masked_fill(future[:, None, None, :], float("-inf")), dim=-1)
        padded = torch.nn.functional.pad(probs, (0, num_blocks * cfg.block_size - length))
        return padded.view(rows, hkv, -1, num_blocks, cfg.block_size).sum(-1).mean(2)


def selection_kl(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cfg: NosaConfig,
                 scale: float) -> tuple[torch.Tensor, int]:
    """(sum over rows and KV heads of KL(dense block mass || query-aware block score) over the
    candidate blocks, the number of (row, head) pairs summed). q [R, Hq, D] at ``positions`` [R]
    of one document whose keys are k [L, Hkv, D]. Differentiable in q and k."""
    num_blocks = cfg.num_blocks(k.shape[0])
    target = dense_block_mass(q, k, positions, num_blocks, cfg, scale)
    scores = query_block_scores(q, compress_windows(k, cfg), positions, num_blocks, cfg, scale)
    exists, forced = forced_blocks(positions, num_blocks, cfg)
    cand = (exists & ~forced)[:, None, :] & torch.isfinite(scores)  # [R, Hkv, NB]
    has = cand.any(dim=-1)  # [R, Hkv]
    if not bool(has.any()):
        return q.sum() * 0.0, 0
    s = torch.where(cand, scores, 0.0)
    s = s / s.sum(dim=-1, keepdim=True).clamp(min=EPS)
    t = torch.where(cand, target, 0.0)
    t = t / t.sum(dim=-1, keepdim=True).clamp(min=EPS)
    kl = (t * (t.clamp(min=EPS).log() - s.clamp(min=EPS).log())).sum(dim=-1)
    return kl[has].sum(), int(has.sum())


def loss_rows(weights: torch.Tensor, answers: torch.Tensor, position_ids: torch.Tensor, cfg: NosaConfig,
              limit: int, generator: torch.Generator) -> torch.Tensor:
    """The rows the loss is taken at, ascending: weights [L] (the token loss's row weights,
    nosa.train.loss.row_weights: row t predicts token t + 1), answers [L] bool (answer tokens),
    position_ids [L] (restarting per document). The rows that predict an answer token, then random
    other labelled rows, ``limit`` in all, only rows with a choice (two candidate blocks or more: over
    one, both distributions are 1 and the KL is 0). Where more rows predict answers than ``limit``
    (a prose row, all of whose tokens are targets), a random ``limit`` of them: the first ones would
    be the rows nearest the document's start, with the fewest candidates."""
    exists, forced = forced_blocks(position_ids, int(position_ids.max()) // cfg.block_size + 1, cfg)
    has_choice = (exists & ~forced).sum(dim=-1) >= 2
    eligible = (weights > 0) & has_choice
    predicts_answer = torch.cat([answers[1:], answers.new_zeros(1)])
    first = (eligible & predicts_answer).nonzero().squeeze(1)
    first = first[torch.randperm(first.numel(), generator=generator)[:limit]]
    others = (eligible & ~predicts_answer).nonzero().squeeze(1)
    others = others[torch.randperm(others.numel(), generator=generator)[: limit - first.numel()]]
    return torch.cat([first, others]).sort().values


def selection_loss(captured: dict, model, labels: torch.Tensor, answers: torch.Tensor, position_ids: torch.Tensor,
                   answer_weight: float, limit: int, generator: torch.Generator) -> torch.Tensor:
    """The mean over layers of ``selection_kl`` averaged over its rows and KV heads: ``captured``
    from ``nosa.hf.capture_attention_inputs(model, batch_row=None, detach=False)`` (per layer
    q [B, S, Hq, D], k [B, S, Hkv, D]); labels, answers, position_ids [B, S] of the micro batch.
    The same rows (``loss_rows``) in every layer."""
    weights = torch.stack([row_weights(lab, ans, answer_weight) for lab, ans in zip(labels, answers)])
    if not captured:
        raise ValueError("selection_loss: no attention inputs were captured (is the model a NOSA model?)")
    some = next(iter(captured))
    cfg = model.get_submodule(some)._nosa_config
    # per batch row: (document start, its rows) for every document with loss rows
    docs = []
    for b in range(weights.shape[0]):
        rows = loss_rows(weights[b], answers[b], position_ids[b], cfg, limit, generator)
        starts = rows - position_ids[b, rows]
        docs.append([(int(start), rows[starts == start]) for start in starts.unique().tolist()])
    layers = []
    for name, (q, k, _) in captured.items():
        module = model.get_submodule(name)
        total, count = q.new_zeros((), dtype=torch.float32), 0
        for b, row_docs in enumerate(docs):
            for start, doc_rows in row_docs:
                end = int(doc_rows.max()) + 1
                kl, n = selection_kl(q[b, doc_rows], k[b, start:end], doc_rows - start, module._nosa_config,
                                     module.scaling)
                total, count = total + kl, count + n
        if count:
            layers.append(total / count)
    if not layers:
        return next(iter(captured.values()))[0].sum() * 0.0
    return torch.stack(layers).mean()
