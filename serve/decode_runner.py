"""DecodeRunner: the nosa backend's decode step on fixed shapes, so that a graph runner can capture it.

Host side, ``prepare(metadata)`` before a step (never captured): the step's requests written into
fixed buffers (nosa.serve.metadata.StepInputs), each decode state caught up and given pages.
Device side, ``run_layer`` per layer: select -> resolve (the KV source, a ``LayerResolver``:
``PoolResolver`` reads SGLang's pool in place, the offloading engine resolves through its device
block cache) -> prefetch (not when captured) -> attend. Shapes depend on the batch size and the
configuration (and, when graphs are captured, the server's longest context), never on the data,
and nothing reads a value back to the host. Imports nothing of SGLang (tests build it over plain
tensors).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from nosa.decode import WantedBlocks, attend_resolved, read_blocks, read_width
from nosa.kv import DeviceRows, KVView, PagedKV, paged_rows
from nosa.serve.metadata import ForwardMetadata, InputBuffers, ReadSpans, StepInputs, captured
from nosa.serve.offload.resolve import NewTokens
from nosa.state_pool import StatePool


class LayerResolver(Protocol):
    """What DecodeRunner needs of its KV source (PoolResolver, nosa.serve.offload.engine.OffloadEngine).

    - ``in_place``: True when the KV is SGLang's device pool, read where it lies; the resolver is
      then also an ``InPlaceResolver`` (window keys, scores of others' tokens, dense attention);
    - ``view(layer, metadata)`` -> KVView: host side, the requests' tokens (a state catching up);
    - ``resolve_layer(layer, wanted, inputs, new_tokens)`` -> DeviceRows: device side, fixed shapes,
      the wanted blocks (nosa.decode.WantedBlocks [R, Hkv, W]) of the step's requests (StepInputs),
      with their new tokens (NewTokens: k, v [R, Hkv, D], cis [R, Hkv]) written where needed."""

    in_place: bool

    def view(self, layer: int, metadata: ForwardMetadata) -> KVView: ...

    def resolve_layer(self, layer: int, wanted: WantedBlocks, inputs: StepInputs,
                      new_tokens: NewTokens) -> DeviceRows: ...


class InPlaceResolver(LayerResolver, Protocol):
    """A LayerResolver over SGLang's device pool (``in_place`` True), which also offers
    ``fill_cis(layer, slots [n])`` (eviction scores of tokens another prefill backend wrote),
    ``window_keys(layer, inputs, kernel)`` -> [R, kernel, Hkv, D] (when the state pool keeps no key
    tails) and ``attend_dense(layer, q [R, Hq, D], contexts, scale)`` -> [R, Hq, Dv] (a step that
    is not captured, every request within dense_len)."""

    def fill_cis(self, layer: int, slots: torch.Tensor) -> None: ...

    def window_keys(self, layer: int, inputs: StepInputs, kernel: int) -> torch.Tensor: ...

    def attend_dense(self, layer: int, q: torch.Tensor, contexts, scale: float) -> torch.Tensor: ...


class PoolResolver:
    """The InPlaceResolver of SGLang's token-slot KV pool, as the decode step reads it (offloading
    off): ``pool`` has get_key_buffer / get_value_buffer(layer) [slots, Hkv, D]; ``cis`` [layers] of
    [slots, Hkv] float32, the eviction scores the backend keeps beside it; ``req_to_token`` [rows,
    max_ctx]; ``heads`` the layers' eviction heads (for tokens another prefill backend wrote).
    ``layer`` arguments are NOSA layers; ``layer_ids`` maps them to the pool's (SGLang's) layer ids
    (None: the same; a hybrid model's sliding-window layers have no NOSA layer)."""

    in_place = True

    def __init__(self, pool, cis: list[torch.Tensor], req_to_token: torch.Tensor, heads, block_size: int,
                 layer_ids: list[int] | None = None):
        self.pool = pool if layer_ids is None else _LayerMap(pool, layer_ids)
        self.cis, self.req_to_token, self.heads = cis, req_to_token, heads
        self.block_size = block_size

    def view(self, layer: int, metadata: ForwardMetadata) -> PagedKV:
        """Host side: the KV view of the step's requests (lengths as ``metadata`` says)."""
        return PagedKV(self.pool.get_key_buffer(layer), self.pool.get_value_buffer(layer), self.cis[layer],
                       self.req_to_token, metadata.table_rows, metadata.lengths)

    def fill_cis(self, layer: int, slots: torch.Tensor) -> None:
        """Eviction scores of tokens at pool ``slots`` that nosa did not write (a prefill by
        another backend: --prefill-attention-backend torch_native), from their V."""
        slots = slots.long()
        self.cis[layer][slots] = self.heads[layer](self.pool.get_value_buffer(layer)[slots])

    def window_keys(self, layer: int, inputs: StepInputs, kernel: int) -> torch.Tensor:
        """Device side: [R, kernel, Hkv, D] the keys of each request's last ``kernel`` tokens (the
        compressed window its new token may complete; clamped to token 0 for a shorter context)."""
        positions = (inputs.lengths[:, None] - kernel + torch.arange(kernel, device=inputs.lengths.device)).clamp(min=0)
        where = inputs.rows[:, None] * self.req_to_token.shape[1] + positions
        slots = self.req_to_token.reshape(-1).index_select(0, where.flatten()).long()
        return self.pool.get_key_buffer(layer).index_select(0, slots).view(*positions.shape, -1,
                                                                             self.pool.get_key_buffer(layer).shape[-1])

    def attend_dense(self, layer: int, q: torch.Tensor, contexts, scale: float) -> torch.Tensor:
        """Host side (a step that is not captured, every request within dense_len): q [R, Hq, D]
        over each request's whole context, ``contexts`` its (row, length), with no exp(cis)
        weighting, gathered by token like torch_native -> [R, Hq, Dv]."""
        k_pool, v_pool = self.pool.get_key_buffer(layer), self.pool.get_value_buffer(layer)
        out = q.new_empty(*q.shape[:2], v_pool.shape[-1])
        for i, (row, length) in enumerate(contexts):
            slots = self.req_to_token[row, :length]
            k = k_pool.index_select(0, slots).to(q.dtype).movedim(0, 1)  # [Hkv, n, D]
            v = v_pool.index_select(0, slots).to(q.dtype).movedim(0, 1)
            # one query row: every key is visible, no mask
            out[i] = F.scaled_dot_product_attention(q[i][:, None], k, v, scale=scale, enable_gqa=True)[:, 0]
        return out

    def resolve_layer(self, layer: int, wanted: WantedBlocks, inputs: StepInputs, new_tokens: NewTokens) -> DeviceRows:
        """Device side: the wanted blocks' rows, read in place (the new tokens are in the pool)."""
        return paged_rows(self.pool.get_key_buffer(layer), self.pool.get_value_buffer(layer), self.cis[layer],
                          self.req_to_token, inputs.rows, wanted.blocks, inputs.lengths, self.block_size)


class _LayerMap:
    """SGLang's KV pool read by NOSA layer (the i-th layer with NOSA attention)."""

    def __init__(self, pool, layer_ids: list[int]):
        self.pool, self.layer_ids = pool, layer_ids

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.pool.get_key_buffer(self.layer_ids[layer])

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.pool.get_value_buffer(self.layer_ids[layer])


class DecodeRunner:
    """The decode step of one backend. ``states``: the request registry (nosa.serve.registry
    .RequestRegistry, NosaDecodeState per (row, layer), here rows of ``pool``); ``kv``: the
    LayerResolver (PoolResolver, or the offloading engine, whose ``prefetch`` the caller passes to
    ``run_layer``); ``spare_group``: offloading, the block cache's group of padding rows. Raises
    ValueError for a state pool without key tails over a resolver that is not in place."""

    def __init__(self, cfg, num_layers: int, states, pool: StatePool, kv: LayerResolver, device,
                 spare_group: int | None = None):
        self.cfg, self.num_layers, self.states, self.pool, self.kv = cfg, num_layers, states, pool, kv
        self.in_place: InPlaceResolver | None = kv if kv.in_place else None  # the optional parts, if any
        if not pool.key_tails and self.in_place is None:
            raise ValueError(f"DecodeRunner: a state pool without key tails reads the window keys from the KV "
                             f"pool, which {type(kv).__name__} does not read in place")
        self.spare_group = spare_group
        self.buffers = InputBuffers(8, device)
        self.graphs = False  # init_graph_state: spans fixed, buffers never reallocated
        self.inputs: StepInputs | None = None

    def init_graph_state(self, max_bs: int) -> None:
        """A graph runner will capture batches of up to ``max_bs`` requests: from now on every step
        reads the longest context's spans from buffers that never move."""
        self.buffers = InputBuffers(max_bs, self.buffers.device)
        self.graphs = True
        # a CUDA graph holds the pool's addresses; SGLang's CPU graph runner recompiles if it grows
        self.pool.frozen = torch.device(self.buffers.device).type == "cuda"

    def static_spans(self) -> ReadSpans:
        """The spans of a step that may be captured. A CUDA graph replays its kernels' launches as
        recorded: it reads the longest context's spans. SGLang's CPU graph runner replays code
        torch.compile generated, in which the selection picks one of a few context buckets on the
        step's lengths (StatePool.select with no spans): a server sized for long contexts then runs
        its short requests' steps without scoring the longest context's compressed keys."""
        if torch.device(self.buffers.device).type == "cuda":
            return ReadSpans(self.pool.max_windows, self.pool.max_blocks, read_width(self.cfg), True)
        return ReadSpans(None, None, read_width(self.cfg), True)

    # ---- host side -----------------------------------------------------------------------------
    def prepare(self, metadata: ForwardMetadata, warm: list[bool] | None = None) -> StepInputs:
        """Host side of a decode step (never captured): its requests' states caught up and given
        pages; what only the host knows written into the inputs (how many rows are requests, warm
        groups, the spans). ``metadata``: rows (0 = padding, after the requests) and lengths (with the
        new token); ``warm``: per row, its device group was warm (offloading; counters). The rows
        and lengths themselves are copied by ``fill``."""
        cfg = self.cfg
        real = [i for i, row in enumerate(metadata.rows) if row]
        views = {}
        for layer in range(self.num_layers):
            for i in real:
                self._catch_up(metadata, i, layer, views)
        inputs = self.buffers.view(len(metadata.rows), grow=not self.graphs)
        device = inputs.rows.device
        inputs.num_real.fill_(len(real))
        inputs.warm.copy_(torch.tensor(warm if warm is not None else [False] * len(metadata.rows), device=device))
        if self.graphs:
            inputs.spans = self.static_spans()
        else:
            lengths = [metadata.lengths[i] for i in real] or [1]
            dense = [n for n in lengths if n <= cfg.dense_len]
            width = max(cfg.topk_blocks, cfg.num_blocks(max(dense))) if dense else cfg.topk_blocks
            only_dense = None
            if real and len(dense) == len(lengths) and self.in_place is not None:
                only_dense = tuple((metadata.rows[i], metadata.lengths[i]) for i in real)
            completes = any((n >= cfg.compress_kernel and (n - cfg.compress_kernel) % cfg.compress_stride == 0)
                            or n % cfg.block_size == 0 for n in lengths)
            inputs.spans = ReadSpans(cfg.num_compressed(max(lengths)), cfg.num_blocks(max(lengths)), width, False,
                                     completes, only_dense)
        self.inputs = inputs
        return inputs

    def fill(self, rows: torch.Tensor, lengths: torch.Tensor) -> None:
        """Device side of the step's metadata (a CUDA graph records it; no host synchronisation):
        the rows [R] and lengths [R] of the batch, as the graph runner's own buffers hold them
        (padding rows: row 0), copied into the inputs ``prepare`` chose; padding rows found."""
        inputs = self.inputs
        inputs.rows.copy_(rows)
        inputs.lengths.copy_(lengths)
        first = torch.arange(rows.shape[0], device=rows.device) < inputs.num_real
        inputs.real.copy_(first & (inputs.rows != 0))
        if self.spare_group is not None:
            inputs.groups.copy_(torch.where(inputs.real, inputs.rows - 1, self.spare_group))

    def _catch_up(self, metadata: ForwardMetadata, i: int, layer: int, views: dict) -> None:
        """Request i's state of ``layer``: holding its context but the new token, its tails filled,
        pages for the new token; then recorded as advanced by the step (which will do it)."""
        row, length = metadata.rows[i], metadata.lengths[i]
        state = self.states.get(row, layer)
        if state is None or state.length > length - 1:  # a new request, or the row was reused
            state = self.pool.open(row, layer)
            if not self.states.put(row, layer, state):
                return  # the request already left (overlap scheduling): keep nothing
        if state.length < length - 1 or state.store.tails_at != length - 1:
            view = views.get(layer)
            if view is None:
                view = views[layer] = self.kv.view(layer, metadata.without_new_tokens())
            if state.length < length - 1:
                if self.in_place is not None:
                    # tokens another prefill backend wrote have no cis yet: compute it from V
                    self.in_place.fill_cis(layer, metadata.slots[i][state.length : length - 1])
                state.append(view, seq=i)
            self.pool.refill_tails(layer, row, view, i, length - 1)
        self.pool.reserve(row, length)
        state.advanced(length)
        state.store.tails_at = length
        state.selection = self.pool.selection[layer][row]

    # ---- device side -----------------------------------------------------------------------------
    def run_layer(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cis: torch.Tensor,
                  scale: float, prefetch=None) -> torch.Tensor:
        """One layer of the step for the batch of ``prepare``: q [R, Hq, D], the new tokens' k, v
        [R, Hkv, D] and cis [R, Hkv] (already in the KV pool) -> out [R, Hq, Dv].
        select -> resolve -> prefetch (``prefetch()``, host work the caller passes; skipped when the
        step is captured) -> attend."""
        inputs, spans = self.inputs, self.inputs.spans
        # 1. select: the state takes the new token, then one batched selection; the blocks to read
        if spans.completes:
            window = None if self.pool.key_tails else self.in_place.window_keys(layer, inputs, self.cfg.compress_kernel)
            self.pool.advance(layer, inputs.rows, inputs.lengths, k, cis, window)
        else:  # no window and no block completes: the state only records the token
            self.pool.record(layer, inputs.rows, inputs.lengths, k, cis)
        if spans.dense is not None:  # every request within dense_len, the step not captured
            return self.in_place.attend_dense(layer, q, spans.dense, scale)
        sel = self.pool.select(layer, inputs.rows, inputs.lengths, q, scale, spans.windows, spans.blocks)
        wanted = read_blocks(sel, inputs.lengths, self.cfg, spans.width)
        # 2. resolve: where those blocks are (offloading: hits stay, misses recalled from the host)
        found = self.kv.resolve_layer(layer, wanted, inputs, NewTokens(k, v, cis))
        # 3. prefetch: the next layer's predicted blocks start moving while this layer attends
        if prefetch is not None and not captured():
            prefetch()
        # 4. attend
        out, _ = attend_resolved(q, found, wanted.dense, self.cfg.block_size, scale, static=spans.static)
        return out

