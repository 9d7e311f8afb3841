"""Block selection: the one implementation used by training (nosa.hf), serving (nosa.serve) and the
demos. Nothing else in the project decides which blocks a query attends to.

Shapes: R query rows (tokens; rows of a prefill or one row per decoding sequence), Hq query heads,
Hkv KV heads, G = Hq // Hkv, D head dim, C compressed windows, NB blocks, K = topk_blocks.

Selection for a query at position t (context length t + 1, current block cur = t // block_size):

1. Forced blocks F: the sink blocks ``[0, sink_blocks)`` and the local window
   ``(cur - window_blocks, cur]``, which includes the current, partial block.
2. Free picks P: the ``query_blocks`` best other blocks by the query-aware score (softmax of q over
   the visible compressed keys, summed over the G query heads of the KV head, max-pooled onto
   blocks). Q = F | P is the query-aware set.
3. The rest of the budget, ``K - |Q|`` blocks, goes to the blocks with the highest static eviction
   score (the eviction head ``cis`` max-pooled onto blocks). Max pooling gives two neighbouring
   blocks the same score whenever their best window straddles the boundary, and repeated text gives
   distant blocks identical keys, so ties are common: they are broken by the static block mean of
   ``cis``, then by the lower block index, which keeps this part static. A KV head whose eviction
   head is off (A = 0: every static key of an existing block exactly 0, or -inf where no window is
   complete yet) ranks these blocks by the query-aware score instead (then by index): that is
   exactly InfLLM-v2's query-aware top-K, the training-free mode.

If at most K blocks exist, all of them are selected.

Locality theorem. For a KV head whose eviction head is on (A != 0), between two consecutive decode
steps at most ``query_blocks + 1`` blocks enter the selection, and the ``+ 1`` (the new current
block) only on a step that starts a new block.
Proof sketch: let CAND be the blocks outside F and n = K - |F|. Every block among the top
``n - query_blocks`` of CAND by eviction score is selected (at most ``query_blocks`` of the blocks
ranked above it are free picks). NosaConfig requires a block's pooled scores to be final before it
leaves the window, and ties fall to the block index, so the ranking of CAND is static; from one step
to the next CAND gains at most the block that just left the window (which was selected as part of
F) and loses none. Hence the
static top ``n - query_blocks`` of the new step were all selected before, and a new block can only be
one of the ``query_blocks`` other selected blocks or the window's new current block. With A = 0 the
ranking falls to the query-aware score and only the budget bounds the churn.
"""

from __future__ import annotations

import dataclasses

import torch

from nosa.compress import pool_to_blocks
from nosa.config import NosaConfig
from nosa.layout import NEG_INF


def query_block_scores(
    q: torch.Tensor,
    compressed_k: torch.Tensor,
    positions: torch.Tensor,
    num_blocks: int,
    cfg: NosaConfig,
    scale: float,
) -> torch.Tensor:
    """Query-aware block scores.

    q: [R, Hq, D]; compressed_k: [C, Hkv, D]; positions: [R] (token position of each row).
    Returns [R, Hkv, NB] float32: max over the windows overlapping a block of the group-summed
    softmax; ``-inf`` for blocks with no window visible to the row. Window ``j`` is visible to the
    row at position t when it lies entirely at or before t.
    """
    rows, hq, d = q.shape
    num_windows, hkv, _ = compressed_k.shape
    group = hq // hkv
    # head-major [Hkv, R * G, C] logits straight out of one bmm (no permuted copy); the softmax and
    # the group sum see the same values in the same order as in block_scores_from_logits (decode),
    # so prefill and decode select alike
    qh = q.float().reshape(rows, hkv, group, d).transpose(0, 1).reshape(hkv, rows * group, d)
    logits = torch.bmm(qh, compressed_k.float().permute(1, 2, 0)).mul_(scale)
    window_end = torch.arange(num_windows, device=q.device) * cfg.compress_stride + cfg.compress_kernel
    visible = window_end[None, :] <= positions[:, None] + 1  # [R, C]
    # windows every row sees need no mask: only the last few columns (the rows' positions differ
    # by less than a chunk) are masked, not the whole [R, C]
    seen_by_all = int(visible.all(dim=0).sum()) if rows else 0
    tail = logits.view(hkv, rows, group, num_windows)[..., seen_by_all:]
    tail.masked_fill_(~visible[None, :, None, seen_by_all:], NEG_INF)
    probs = torch.softmax(logits, dim=-1)
    if seen_by_all == 0:  # some row sees no window: its softmax is NaN, its probabilities 0
        probs = probs.nan_to_num(0.0)
    scores = probs.view(hkv, rows, group, num_windows).sum(dim=2).masked_fill_(~visible[None], NEG_INF)
    return pool_to_blocks(scores, num_blocks, cfg).transpose(0, 1)


def block_scores_from_logits(
    logits: torch.Tensor, visible: torch.Tensor, num_blocks: int, cfg: NosaConfig
) -> torch.Tensor:
    """The second half of ``query_block_scores``, for callers that compute the logits themselves
    (batched decode, where every sequence has its own compressed keys).

    logits: [R, Hkv, G, C] scaled q . compressed-key logits; visible: [R, C] bool, the windows each
    row may see (entries beyond a row's own windows must be False). Returns [R, Hkv, NB].
    """
    logits = logits.masked_fill(~visible[:, None, None, :], NEG_INF)
    probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)  # rows with no visible window: all 0
    scores = probs.sum(dim=2).masked_fill(~visible[:, None, :], NEG_INF)  # [R, Hkv, C]
    return pool_to_blocks(scores, num_blocks, cfg)


def forced_blocks(positions: torch.Tensor, num_blocks: int, cfg: NosaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(exists, forced), both [R, NB] bool, of query rows at ``positions`` [R]: the blocks up to the
    row's current block, and among them the forced set F (sinks and the local window). The other
    existing blocks are the candidates that the free picks and the eviction ranking choose from."""
    block = torch.arange(num_blocks, device=positions.device)
    cur = (positions // cfg.block_size)[:, None]  # [R, 1]
    exists = block[None, :] <= cur
    forced = exists & ((block[None, :] < cfg.sink_blocks) | (block[None, :] > cur - cfg.window_blocks))
    return exists, forced


def select_blocks(
    query_scores: torch.Tensor,
    evict_scores: torch.Tensor,
    positions: torch.Tensor,
    cfg: NosaConfig,
    branch_free: bool = False,
) -> torch.Tensor:
    """The selected blocks of every row and KV head.

    query_scores: [R, Hkv, NB]; evict_scores: [R, Hkv, NB, 2] or broadcastable ([1, Hkv, NB, 2]),
    the static keys (pooled score, block mean) of nosa.eviction.block_eviction_scores;
    positions: [R]. Returns [R, Hkv, K] long, ascending block indices, padded with -1 at the end
    when fewer than K blocks exist. ``branch_free``: no Python branch on tensor values (so no host
    synchronisation: a captured decode step), the same result.
    """
    rows, hkv, nb = query_scores.shape
    device = query_scores.device
    exists, forced = forced_blocks(positions, nb, cfg)
    forced = forced[:, None, :]  # [R, 1, NB], broadcast over heads
    exists = exists[:, None, :]

    qs = query_scores.float().nan_to_num(nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF)
    # the static keys keep their own leading size (1 when shared by every row, as in a prefill):
    # everything derived from them alone is computed once, then broadcast over the rows
    evict = evict_scores.float().nan_to_num(nan=NEG_INF, posinf=float("inf"), neginf=NEG_INF)
    if evict.dim() != 4 or evict.shape[1:] != (hkv, nb, 2) or evict.shape[0] not in (1, rows):
        evict = evict.expand(rows, hkv, nb, 2)

    # Free picks: best query-aware scores among existing, non-forced blocks with a finite score,
    # ties to the lower index.
    in_query_set = forced.expand(rows, hkv, nb)
    ordered_qs = _ordered(qs)
    if cfg.query_blocks > 0:
        cand = (exists & ~forced) & torch.isfinite(qs)
        pick_key = (torch.where(cand, ordered_qs, _ORDERED_NEG_INF) << _INDEX_BITS) | _lower_index_first(nb, device)
        order = pick_key.topk(min(cfg.query_blocks, nb), dim=-1).indices
        picked = cand.gather(-1, order)
        in_query_set = in_query_set | _scatter_mask(order, picked, nb)

    # Lexicographic ranking: (query set, eviction score, block mean, query score, -index). The query
    # score only ranks for heads whose eviction head is off (every existing static key exactly 0 or
    # infinite). Keys are mapped to order-preserving integers: ``major`` (tier, eviction score) and a
    # unique ``minor`` (block mean, query score, -index); the budget is every block whose major key
    # beats the k-th largest, then the best ties at that key by minor. Top-k, never a full sort.
    live = _live_heads(exists, evict)  # [R, Hkv]
    index_key = _lower_index_first(nb, device)
    mean = evict[..., 1]
    # The branches only skip work: with every head live (training, fine-tuned models) the query
    # score never ranks; with none (A = 0) the block mean only separates -inf / 0 / inf.
    all_live = not branch_free and bool(live.all())
    if all_live:
        minor = (_ordered(mean) << _INDEX_BITS) | index_key
    else:
        mean_class = (mean > NEG_INF).long() + (mean == float("inf")).long()  # dead heads: -inf < 0 < inf
        minor_dead = (mean_class << 61) | ((ordered_qs + 2**31) << _INDEX_BITS) | index_key
        if branch_free or bool(live.any()):
            minor_live = (_ordered(mean) << _INDEX_BITS) | index_key
            minor = torch.where(live[..., None], minor_live, minor_dead)
        else:
            minor = minor_dead
    tier = (exists.long() + in_query_set.long()) << 32  # 2: Q, 1: other, 0: future
    major = tier | (_ordered(evict[..., 0]) + 2**31)
    k = min(cfg.topk_blocks, nb)
    threshold = major.topk(k, dim=-1).values[..., -1:]  # the k-th largest major key
    above = major > threshold
    need = k - above.sum(dim=-1, keepdim=True)
    ties = torch.where(major != threshold, torch.iinfo(torch.int64).min, minor).topk(k, dim=-1).indices
    chosen = above | _scatter_mask(ties, torch.arange(k, device=device) < need, nb)
    # ascending block indices of the chosen existing blocks, -1 after them
    order_key = torch.where(chosen & exists, index_key, -1)
    top = order_key.topk(k, dim=-1)
    chosen = torch.where(top.values >= 0, top.indices, -1)
    if k < cfg.topk_blocks:
        pad = chosen.new_full((rows, hkv, cfg.topk_blocks - k), -1)
        chosen = torch.cat([chosen, pad], dim=-1)
    return chosen


def static_selection(evict_scores: torch.Tensor, positions: torch.Tensor, cfg: NosaConfig) -> torch.Tensor:
    """The part of the selection that does not depend on the query, for prefetching.

    evict_scores: [R, Hkv, NB, 2] static block keys; positions: [R], the position the query will
    have. Returns [R, Hkv, K] long, ascending, -1 padded: the forced blocks (sinks, window) and,
    for heads whose eviction head is on, the top ``K - |F| - query_blocks`` other blocks by static
    eviction score. By the locality theorem these are selected whatever the query is, so
    ``static_selection(...)`` is a subset of ``select_blocks(any query scores, ...)`` row by row.
    Heads with A = 0 rank by the query, so only their forced blocks are static.
    """
    rows, hkv, nb, _ = evict_scores.shape
    static_cfg = dataclasses.replace(cfg, topk_blocks=cfg.topk_blocks - cfg.query_blocks, query_blocks=0)
    no_query = evict_scores.new_full((rows, hkv, nb), NEG_INF)
    sel = select_blocks(no_query, evict_scores, positions, static_cfg)  # [R, Hkv, K - P]
    block = torch.arange(nb, device=evict_scores.device)
    cur = (positions // cfg.block_size)[:, None, None]
    exists = (block[None, :] <= cur[:, 0])[:, None, :].expand(rows, hkv, nb)
    live = _live_heads(exists, evict_scores.float())  # [R, Hkv]
    forced = (sel >= 0) & ((sel < cfg.sink_blocks) | (sel > cur - cfg.window_blocks))
    sel = torch.where(live[..., None] | forced, sel, -1)
    last = torch.iinfo(torch.int64).max  # ascending block indices, the dropped ones (-1) at the end
    sel = torch.where(sel >= 0, sel, last).sort(dim=-1).values
    sel = torch.where(sel == last, -1, sel)
    pad = sel.new_full((rows, hkv, cfg.query_blocks), -1)
    return torch.cat([sel, pad], dim=-1)


def selection_change(previous: torch.Tensor, current: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Which blocks entered and which left between two selections.

    previous, current: [..., K] block indices (-1 = none). Returns (entered, left), both [..., K]
    long: the blocks of ``current`` not in ``previous`` and of ``previous`` not in ``current``,
    in their original order, the other entries -1."""
    prev, cur = previous.unsqueeze(-1), current.unsqueeze(-2)
    same = (prev == cur) & (prev >= 0)  # [..., K, K]
    entered = torch.where((current >= 0) & ~same.any(dim=-2), current, -1)
    left = torch.where((previous >= 0) & ~same.any(dim=-1), previous, -1)
    return entered, left


def selection_mask(selection: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[..., K] block indices (-1 = none) -> [..., NB] bool."""
    valid = selection >= 0
    index = selection.clamp(min=0)
    return _scatter_mask(index, valid, num_blocks)


def blocks_entering(previous: torch.Tensor, current: torch.Tensor) -> torch.Tensor:
    """How many selected blocks of ``current`` were not in ``previous``, per leading index.

    previous, current: [..., K] block indices (-1 = none). Returns [...] long.
    """
    prev = previous.unsqueeze(-1)  # [..., K, 1]
    cur = current.unsqueeze(-2)  # [..., 1, K]
    present = ((prev == cur) & (prev >= 0)).any(dim=-2)  # [..., K]
    return ((current >= 0) & ~present).sum(dim=-1)


def _live_heads(exists: torch.Tensor, evict: torch.Tensor) -> torch.Tensor:
    """[R, Hkv] whether a head's eviction head is on: some existing block has a finite, non-zero key."""
    keyed = (torch.isfinite(evict) & (evict != 0)).any(-1)  # [R or 1, Hkv, NB]: a real key
    return (exists & keyed).any(-1)


_INDEX_BITS = 29  # block indices and ranks below 2**29 (contexts up to 2**29 blocks)
_INDEX_MASK = 2**_INDEX_BITS - 1


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 in [-2**31, 2**31) with the same order (-0.0 == 0.0; -inf lowest)."""
    bits = (x.float() + 0.0).view(torch.int32)  # + 0.0 turns -0.0 into 0.0
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()


_ORDERED_NEG_INF = int(_ordered(torch.tensor(NEG_INF)))


def _lower_index_first(nb: int, device) -> torch.Tensor:
    return _INDEX_MASK - torch.arange(nb, device=device)


def _scatter_mask(index: torch.Tensor, valid: torch.Tensor, num_blocks: int) -> torch.Tensor:
    mask = torch.zeros((*index.shape[:-1], num_blocks + 1), dtype=torch.bool, device=index.device)
    mask.scatter_(-1, torch.where(valid, index, num_blocks), True)
    return mask[..., :num_blocks]
