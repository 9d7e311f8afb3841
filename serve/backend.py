"""NosaAttnBackend: SGLang attention with NOSA block selection, the KV in SGLang's pool or offloaded.

Layout (SGLang's, token-major): q [T, Hq*D] viewed as [T, Hq, D]; k, v [T, Hkv, D] for the T new
tokens of the batch; ``req_to_token[row, :seq_len]`` lists the slots of a request's context.
A thin adapter over nosa's code (serving picks the blocks the HF model picks). Per forward pass the
metadata hooks build the ForwardMetadata and, for a decode step, run the host half
(DecodeRunner.prepare); ``forward_decode`` then runs one layer on fixed shapes (DecodeRunner.run_layer:
select -> resolve -> prefetch -> attend), which SGLang's CPU and CUDA decode graph runners capture
(padding rows: request row 0). The KV source: SGLang's device pool plus a cis buffer kept here
(PoolResolver; extend: ``prefill_from_pool``), or with $NOSA_OFFLOAD=1 the host pool through
nosa.serve.offload.engine.OffloadEngine. Decode states: nosa.serve.registry.RequestRegistry; cis
from the checkpoint's eviction heads (nosa.serve.checkpoint; a dense checkpoint has A = 0).
A hybrid model's sliding-window layers (Gemma 3) attend to their window (nosa.serve.window: SGLang's
pool, or with offloading a device ring); every NOSA part counts the other layers only, as NOSA
layer 0..n-1 (``self.nosa_index``: SGLang layer id -> NOSA layer).
"""

from __future__ import annotations

import functools
import logging
from typing import NamedTuple

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from nosa.attention.prefill import prefill_attention
from nosa.checkpoint_format import nosa_layers
from nosa.decode import NosaDecodeState
from nosa.serve import metrics
from nosa.serve.checkpoint import (
    load_eviction_heads,
    load_nosa_config,
    resolve_model_dir,
    zero_eviction_heads,
)
from nosa.serve.decode_runner import DecodeRunner, PoolResolver
from nosa.serve.metadata import ForwardMetadata, captured
from nosa.serve.offload.engine import OffloadEngine
from nosa.serve.offload.kv import exact_prefill_keys
from nosa.serve.offload.settings import offload_enabled
from nosa.serve.parallel import KVHeadShard
from nosa.serve.registry import RequestRegistry
from nosa.serve.startup import check_hybrid_offload
from nosa.serve.window import PoolWindows, RingWindows
from nosa.state_pool import StatePool, pages_for

logger = logging.getLogger(__name__)


def prefill_from_pool(q, k_buf, v_buf, cis_buf, slots, cfg, scale: float) -> torch.Tensor:
    """The extend of one request (offloading off): its new rows q [n, Hq, D] over its whole context,
    read from a token-slot pool: k_buf, v_buf [S, Hkv, D], cis_buf [S, Hkv] (the eviction scores
    stored with each token when it was written, so no extend recomputes the context's), slots [L]
    the context's slots, its new tokens last. Returns out [n, Hq, D], ``nosa_prefill``'s output.
    Rows within dense_len attend densely without a selection (``prefill_attention``)."""
    slots = slots.long()
    return prefill_attention(q, k_buf[slots].to(q.dtype), v_buf[slots].to(q.dtype), cis_buf[slots], cfg, scale)


class LayerIO(NamedTuple):
    """A layer's query and output: out [T, Hq*Dv] (what the layer returns), q [T, Hq, D] and o
    [T, Hq, Dv] (views the attention reads and writes)."""

    out: torch.Tensor
    q: torch.Tensor
    o: torch.Tensor


class NosaAttnBackend(AttentionBackend):
    def __init__(self, model_runner):
        super().__init__()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        model_config = model_runner.model_config
        text_config = model_config.hf_text_config
        layers = nosa_layers(text_config)
        self.nosa_index = {layer_id: i for i, layer_id in enumerate(layers)}
        self.num_layers = len(layers)  # NOSA layers: the model's, less its sliding-window ones
        self.shard = KVHeadShard.of_process(text_config, model_runner.server_args)  # this TP rank's KV heads
        self.num_kv_heads = self.shard.local
        self.head_dim = model_config.head_dim

        model_dir = resolve_model_dir(model_config.model_path, getattr(model_config, "revision", None))
        self.config, from_checkpoint = load_nosa_config(model_dir)
        if from_checkpoint:
            self.heads = load_eviction_heads(model_dir, layers, self.shard, self.head_dim, self.device)
        else:
            self.heads = zero_eviction_heads(self.num_layers, self.num_kv_heads, self.head_dim, self.device)
        source = "checkpoint" if from_checkpoint else "NOSA_CONFIG / defaults (dense checkpoint, A = 0)"
        logger.info("nosa backend: %s from %s", self.config, source)
        self.states = self._attach_states(model_runner)
        self.metadata: ForwardMetadata | None = None  # the forward pass running (init_forward_metadata)
        self.offload = None
        if offload_enabled():
            self.offload = OffloadEngine.start(model_runner, self.config, self.num_layers, self.num_kv_heads,
                                               self.head_dim, model_dir, self.shard)
            self.states.attach_offload(self.offload)
            self.states.metrics = self.offload.metrics = metrics.start(model_runner, self.num_layers)
            allocator = model_runner.token_to_kv_pool_allocator
            self.states.host_tokens_in_use = lambda: allocator.size - allocator.available_size()
            kv, spare_group = self.offload, self.offload.cache.spare_group
        else:  # cis per pool slot, beside SGLang's K and V
            rows = self.token_to_kv_pool.get_key_buffer(0).shape[0]
            self.cis_pool = [torch.zeros(rows, self.num_kv_heads, device=self.device) for _ in range(self.num_layers)]
            kv = PoolResolver(self.token_to_kv_pool, self.cis_pool, self.req_to_token_pool.req_to_token, self.heads,
                              self.config.block_size, layers)
            spare_group = None
        self.decode = DecodeRunner(self.config, self.num_layers, self.states, self.states.pool, kv, self.device,
                                   spare_group)
        self.windows = self._windows(model_runner, text_config, layers)

    def _windows(self, model_runner, text_config, layers: list[int]):
        """Where the sliding-window layers' K and V live (None for a model without them)."""
        sliding = [i for i in range(text_config.num_hidden_layers) if i not in self.nosa_index]
        if not sliding:
            return None
        window = text_config.sliding_window
        if self.offload is None:
            return PoolWindows(self.token_to_kv_pool, self.req_to_token_pool.req_to_token, window)
        check_hybrid_offload(len(sliding), model_runner.server_args.disable_radix_cache)
        pool = self.token_to_kv_pool
        rings = RingWindows(sliding, self.req_to_token_pool.req_to_token.shape[0], window, self.num_kv_heads,
                            self.head_dim, pool.v_head_dim, pool.dtype, self.device)
        logger.info("nosa backend: %d sliding-window layers (window %d) on the device: %.1f MiB for %d request rows",
                    len(sliding), window, rings.nbytes / 2**20, self.req_to_token_pool.req_to_token.shape[0] - 1)
        return rings

    def _attach_states(self, model_runner) -> RequestRegistry:
        """One registry per ReqToTokenPool (a prefill and a decode nosa backend share it)."""
        pool = self.req_to_token_pool
        current = getattr(pool, "_aux_cache", None)
        if isinstance(current, RequestRegistry):
            return current
        if current is not None:
            raise ValueError(
                f"nosa backend: the request pool already carries an aux cache ({type(current).__name__});"
                " NOSA cannot be combined with the feature that installed it"
            )
        if not hasattr(pool, "req_generation"):
            raise ValueError(f"nosa backend: unsupported request pool {type(pool).__name__}")
        # dense_capacity: what the pool reports as schedulable tokens once an aux cache is attached;
        # NOSA reserves nothing, so it is the allocator's full size.
        capacity = model_runner.token_to_kv_pool_allocator.size
        states = RequestRegistry(pool, self.num_layers, capacity, self._state_pool(pool.req_to_token, capacity))
        pool.attach_aux_cache(states)
        return states

    def _state_pool(self, req_to_token: torch.Tensor, capacity: int) -> StatePool:
        """The decode states of every request row, for contexts up to the request pool's width; pages
        for ``capacity`` tokens (the KV pool's), more if requests sharing a prefix need them."""
        rows, max_context = req_to_token.shape
        pool = StatePool(self.config, self.num_layers, rows, self.num_kv_heads, self.head_dim, max_context,
                         pages_for(self.config, capacity, rows), self.token_to_kv_pool.dtype, self.device,
                         key_tails=offload_enabled())  # else the step reads window keys from the pool
        logger.info("nosa backend: decode states of %d request rows, contexts up to %d tokens: %.1f MiB",
                    rows - 1, max_context, pool.nbytes / 2**20)
        return pool

    # ---- AttentionBackend ------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch):
        """Once per forward pass, before its layers: the ForwardMetadata every layer reads; for a decode
        step both halves of its metadata (a step SGLang runs eagerly, or the CPU graph runner's)."""
        self.init_forward_metadata_out_graph(forward_batch)
        if self.metadata.decode:
            self.init_forward_metadata_in_graph(forward_batch)

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Host half (never captured; before capture and before every replay): the ForwardMetadata; for
        a decode step the states caught up and given pages (nosa.serve.decode_runner.DecodeRunner.prepare).
        Padding rows (row 0) of a graph's batch count as no request."""
        groups_of = self.offload.groups_of if self.offload is not None else None
        self.metadata = ForwardMetadata.of(forward_batch, self.req_to_token_pool.req_to_token, groups_of)
        self._begin(self.metadata)

    def init_forward_metadata_in_graph(self, forward_batch):
        """Device half of a decode step's metadata (recorded into a CUDA graph: no host reads): the
        batch's rows and lengths from the graph runner's buffers into the step's inputs."""
        self.decode.fill(forward_batch.req_pool_indices, forward_batch.seq_lens)

    def _begin(self, metadata: ForwardMetadata) -> None:
        self.states.pool.recycle()
        warm = self.offload.begin(metadata) if self.offload is not None else None
        if metadata.decode:
            self.decode.prepare(metadata, warm)

    # ---- graph runners: SGLang's CPU graph runner (torch.compile) and CUDA graphs ------------------
    def init_cpu_graph_state(self, max_bs: int, max_num_tokens: int):
        """SGLang's CPU graph runner will compile decode batches of up to ``max_bs`` requests."""
        self.decode.init_graph_state(max_bs)

    def init_forward_metadata_capture_cpu_graph(self, bs, num_tokens, req_pool_indices, seq_lens, out_cache_loc,
                                                encoder_lens, forward_mode, spec_info):
        """The metadata of the batch the CPU graph runner compiles with (padding rows only)."""
        groups_of = self.offload.groups_of if self.offload is not None else None
        self.metadata = ForwardMetadata.decode_of(req_pool_indices.tolist(), seq_lens.tolist(),
                                                  self.req_to_token_pool.req_to_token, groups_of, req_pool_indices)
        self._begin(self.metadata)
        self.decode.fill(req_pool_indices, seq_lens)

    def get_cpu_graph_seq_len_fill_value(self):
        return 1

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        """SGLang's decode CUDA graph runner will capture batches of up to ``max_bs`` requests."""
        self.decode.init_graph_state(max_bs)

    def get_cuda_graph_seq_len_fill_value(self):
        """Padding rows have one token (row 0 of req_to_token: slot 0, SGLang's padding slot)."""
        return 1

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        """One layer of an extend (prefill, chunked prefill, prefix-cache hit): each request's new
        rows attend over its whole context."""
        if self._check_layer(layer):
            return self._window_extend(q, k, v, layer, forward_batch, save_kv_cache)
        metadata, layer_id = self.metadata, self.nosa_index[layer.layer_id]
        io = self._layer_io(q, layer)
        self._store_new_tokens(k, v, layer, forward_batch, save_kv_cache)
        view = self.offload.view(layer_id, metadata) if self.offload is not None else None
        start = 0
        for i, (row, slots, n) in enumerate(zip(metadata.rows, metadata.slots, metadata.extend)):
            if n == 0:
                continue
            rows = slice(start, start + n)
            if view is not None:  # reads only the union of each chunk's blocks from the host pool
                state = self._state(row, layer_id, fresh=slots.shape[0] == n, max_length=slots.shape[0] - n)
                ours = view.quantized and self.states.get(row, layer_id) is state
                if ours:  # a quantized pool: the selection's keys stay exact (this chunk's, the ring's)
                    view.exact_keys[i] = exact_prefill_keys(self.states.pool, layer_id, row, state,
                                                            k.view(-1, self.num_kv_heads, self.head_dim)[rows],
                                                            slots.shape[0] - n)
                io.o[rows], _ = state.prefill(io.q[rows], view, layer.scaling, seq=i)
                if ours:  # the row's rings from the exact keys, so its first decode step reads no others
                    self.states.pool.refill_tails(layer_id, row, view, i, state.length)
                    state.store.tails_at = state.length
            else:
                io.o[rows] = self._prefill_from_pool(io.q[rows], slots, layer)
            start += n
        return io.out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        """One layer of a decode step for the whole batch (nosa.serve.decode_runner.DecodeRunner.run_layer:
        select -> resolve -> prefetch -> attend), on the inputs the metadata hooks prepared. Fixed
        shapes and no host reads, so a graph runner can capture it."""
        if self._check_layer(layer):
            return self._window_decode(q, k, v, layer, forward_batch, save_kv_cache)
        layer_id = self.nosa_index[layer.layer_id]
        io = self._layer_io(q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim), layer)
        cis = self._store_new_tokens(k, v, layer, forward_batch, save_kv_cache)  # [R, Hkv]
        prefetch = None
        if self.offload is not None and not captured():
            prefetch = functools.partial(self.offload.prefetch, layer_id + 1, self.metadata, self.states)
        io.o[:] = self.decode.run_layer(layer_id, io.q, k.view(-1, self.num_kv_heads, self.head_dim),
                                        v.view(-1, self.num_kv_heads, v.shape[-1]), cis, layer.scaling, prefetch)
        if self.offload is not None and layer_id == self.num_layers - 1 and not captured():
            self.offload.end_step()  # a captured step's record is made when the next forward begins
            self.states.write_stats(every=1.0)  # the dashboard's file, at most once a second
        return io.out

    def support_triton(self):
        return False

    def _window_extend(self, q, k, v, layer, forward_batch, save_kv_cache):
        """One sliding-window layer of an extend: each request's new rows over its window."""
        io = self._layer_io(q, layer)
        if self.offload is None:  # with offloading the window lives in the ring only
            self._save_kv(k, v, layer, forward_batch, save_kv_cache)
        k, v = k.view(-1, self.num_kv_heads, self.head_dim), v.view(-1, self.num_kv_heads, layer.v_head_dim)
        start = 0
        for row, slots, n in zip(self.metadata.rows, self.metadata.slots, self.metadata.extend):
            if n == 0:
                continue
            rows = slice(start, start + n)
            io.o[rows] = self.windows.extend(layer.layer_id, row, slots, io.q[rows], k[rows], v[rows], layer.scaling)
            start += n
        return io.out

    def _window_decode(self, q, k, v, layer, forward_batch, save_kv_cache):
        """One sliding-window layer of a decode step, all requests at once (fixed shapes)."""
        io = self._layer_io(q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim), layer)
        if self.offload is None:
            self._save_kv(k, v, layer, forward_batch, save_kv_cache)
        io.o[:] = self.windows.decode(layer.layer_id, forward_batch.req_pool_indices, forward_batch.seq_lens, io.q,
                                      k.view(-1, self.num_kv_heads, self.head_dim),
                                      v.view(-1, self.num_kv_heads, layer.v_head_dim), layer.scaling)
        return io.out

    # ---- helpers ---------------------------------------------------------------------------
    def _state(self, row, layer_id, fresh: bool, max_length: int | None = None) -> NosaDecodeState:
        """The row's state; a new one (in the row's pages of the state pool) for a fresh request or
        when the stored one is ahead of ``max_length`` (the row was reused)."""
        state = None if fresh else self.states.get(row, layer_id)
        if state is None or (max_length is not None and state.length > max_length):
            state = self.states.pool.open(row, layer_id)
            if not self.states.put(row, layer_id, state):  # the request already left (overlap scheduling):
                state = NosaDecodeState(self.config, self.num_kv_heads, self.head_dim, device=self.device)  # no pages
        return state

    def _prefill_from_pool(self, q, slots, layer) -> torch.Tensor:
        """NOSA prefill of one request's new rows q [n, Hq, D] over its whole context in SGLang's
        device pool at ``slots`` [L] (offloading off)."""
        pool, layer_id = self.token_to_kv_pool, layer.layer_id
        return prefill_from_pool(q, pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id),
                                 self.cis_pool[self.nosa_index[layer_id]], slots, self.config, layer.scaling)

    def _store_new_tokens(self, k, v, layer, forward_batch, save_kv_cache) -> torch.Tensor:
        """K and V of the forward's new tokens into SGLang's pool (unless SGLang saved them), and
        their eviction scores cis [T, Hkv], computed from V as the pool stores it, into the cis pool
        (offloading: the host pool's). Returns cis."""
        self._save_kv(k, v, layer, forward_batch, save_kv_cache)
        loc, layer_id = forward_batch.out_cache_loc, self.nosa_index[layer.layer_id]
        cis = self.heads[layer_id](v.view(-1, self.num_kv_heads, self.head_dim).to(self.token_to_kv_pool.dtype))
        if self.offload is not None:
            self.token_to_kv_pool.set_cis(layer_id, loc, cis)
        else:
            self.cis_pool[layer_id][loc.long()] = cis
        return cis

    def _save_kv(self, k, v, layer, forward_batch, save_kv_cache) -> None:
        """K and V of the forward's new tokens into SGLang's pool, unless SGLang saved them."""
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc), k, v)

    def _layer_io(self, q, layer) -> LayerIO:
        out = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        return LayerIO(out, q.view(-1, layer.tp_q_head_num, layer.qk_head_dim),
                       out.view(-1, layer.tp_q_head_num, layer.v_head_dim))

    def _check_layer(self, layer) -> bool:
        """Refuse what the backend cannot run; True for a sliding-window layer (nosa.serve.window)."""
        if layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY:
            raise NotImplementedError("nosa backend: only causal decoder self-attention is supported")
        if (getattr(layer, "logit_cap", None) or 0.0) > 0:
            raise NotImplementedError(f"nosa backend: layer {layer.layer_id} soft-caps its logits (logit_cap "
                                      f"{layer.logit_cap}); NOSA attention does not implement it")
        sliding = layer.sliding_window_size is not None and layer.sliding_window_size > -1
        if sliding != (layer.layer_id not in self.nosa_index):
            raise ValueError(f"nosa backend: layer {layer.layer_id} is {'' if sliding else 'not '}a sliding-window "
                             "layer in SGLang's model but the config's layer_types say otherwise")
        if sliding and layer.sliding_window_size + 1 != self.windows.window:
            raise ValueError(f"nosa backend: layer {layer.layer_id} has a window of {layer.sliding_window_size + 1} "
                             f"tokens, the config's sliding_window {self.windows.window}")
        if layer.tp_k_head_num != self.num_kv_heads:
            raise NotImplementedError(
                f"nosa backend: layer {layer.layer_id} has {layer.tp_k_head_num} KV heads on this rank, the "
                f"tensor-parallel layout {self.shard} gives it {self.num_kv_heads}"
            )
        if layer.qk_head_dim != self.head_dim:
            raise ValueError(f"nosa backend: layer head_dim {layer.qk_head_dim} != config {self.head_dim}")
        return sliding
