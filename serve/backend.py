"""NosaAttnBackend: SGLang attention with NOSA block selection (KV in SGLang's own pool).

Layout (SGLang's, token-major): q [T, Hq*D] viewed as [T, Hq, D]; k, v [T, Hkv, D] for the T new
tokens of the batch; the pool's key/value buffers are [slots, Hkv, D] and
``req_to_token[row, :seq_len]`` lists the slots of a request's context in order.

The selection is nosa's, imported, never re-implemented, and used the way nosa.hf uses it, so
that serving and the HF model pick the same blocks:
- extend (prefill, chunked prefill, prefix-cache hits): per request, the whole context is gathered
  from the pool and its new rows (the last extend_len tokens) go through ``nosa_prefill``;
- decode: one ``NosaDecodeState`` per (request row, layer) grows by one token per step (created, or
  caught up, from the pool when missing); ``nosa.decode.decode_attend`` then selects for the whole
  batch and gathers only the selected blocks of every request from the pool through req_to_token,
  in one call per layer (never the whole context).
Per-request state lives in nosa.serve.states.RequestStates, attached to SGLang's ReqToTokenPool so
that finishing, aborting or retracting a request frees it.
Eviction scores cis = A * softplus(W v + b) come from the checkpoint's eviction heads
(nosa.serve.checkpoint); a dense checkpoint has A = 0.
"""

from __future__ import annotations

import logging

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from nosa.attention import nosa_prefill
from nosa.decode import NosaDecodeState, decode_attend
from nosa.serve.checkpoint import (
    load_eviction_heads,
    load_nosa_config,
    resolve_model_dir,
    zero_eviction_heads,
)
from nosa.serve.states import RequestStates

logger = logging.getLogger(__name__)


class NosaAttnBackend(AttentionBackend):
    def __init__(self, model_runner):
        super().__init__()
        self.device = model_runner.device
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        model_config = model_runner.model_config
        text_config = model_config.hf_text_config
        self.num_layers = text_config.num_hidden_layers
        self.num_kv_heads = text_config.num_key_value_heads
        self.head_dim = model_config.head_dim

        model_dir = resolve_model_dir(model_config.model_path, getattr(model_config, "revision", None))
        self.config, from_checkpoint = load_nosa_config(model_dir)
        if from_checkpoint:
            self.heads = load_eviction_heads(
                model_dir, self.num_layers, self.num_kv_heads, self.head_dim, self.device
            )
        else:
            self.heads = zero_eviction_heads(self.num_layers, self.num_kv_heads, self.head_dim, self.device)
        source = "checkpoint" if from_checkpoint else "NOSA_CONFIG / defaults (dense checkpoint, A = 0)"
        logger.info("nosa backend: %s from %s", self.config, source)
        self.states = self._attach_states(model_runner)

    def _attach_states(self, model_runner) -> RequestStates:
        """One registry per ReqToTokenPool (a prefill and a decode nosa backend share it)."""
        pool = self.req_to_token_pool
        current = getattr(pool, "_aux_cache", None)
        if isinstance(current, RequestStates):
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
        states = RequestStates(pool, self.num_layers, model_runner.token_to_kv_pool_allocator.size)
        pool.attach_aux_cache(states)
        return states

    # ---- AttentionBackend ------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch):
        """Per-forward host-side lists read by every layer."""
        rows = forward_batch.req_pool_indices.tolist()
        if forward_batch.seq_lens_cpu is not None:
            seq_lens = forward_batch.seq_lens_cpu.tolist()
        else:
            seq_lens = forward_batch.seq_lens.tolist()
        if forward_batch.forward_mode.is_decode():
            ext = [1] * len(rows)
        elif forward_batch.extend_seq_lens_cpu is not None:
            ext = list(forward_batch.extend_seq_lens_cpu)
        else:
            ext = forward_batch.extend_seq_lens.tolist()
        table = self.req_to_token_pool.req_to_token
        # (row, slots [seq_len] (a view of the request's req_to_token row), extend_len) per request;
        # shared by all layers
        self.forward_metadata = [(row, table[row, :seq_len], n) for row, seq_len, n in zip(rows, seq_lens, ext)]
        self.table_rows = forward_batch.req_pool_indices.long()

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self._check_layer(layer)
        o, q_, o_, k_buf, v_buf = self._prepare(q, k, v, layer, forward_batch, save_kv_cache)
        head = self.heads[layer.layer_id]
        start = 0
        for _, slots, ext_len in self.forward_metadata:
            if ext_len == 0:
                continue
            slots = slots.long()
            k_ctx = k_buf[slots].to(q_.dtype)
            v_ctx = v_buf[slots].to(q_.dtype)
            out, _ = nosa_prefill(
                q_[start : start + ext_len], k_ctx, v_ctx, head(v_ctx), self.config, layer.scaling
            )
            o_[start : start + ext_len] = out
            start += ext_len
        return o

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self._check_layer(layer)
        q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)
        o, q_, o_, k_buf, v_buf = self._prepare(q, k, v, layer, forward_batch, save_kv_cache)
        head = self.heads[layer.layer_id]
        # eviction scores of the new tokens, read back from the pool like every other token's
        cis_new = head(v_buf[forward_batch.out_cache_loc.long()])  # [R, Hkv]
        states = []
        for i, (row, slots, _) in enumerate(self.forward_metadata):
            state = self._decode_state(row, layer.layer_id, slots, k_buf, v_buf, head)
            state.append(k_buf, cis_new[i : i + 1], slots=slots)
            states.append(state)
        # The whole batch in one call: selection for every request, then one gather of the selected
        # blocks from the pool through req_to_token; never the whole context.
        o_[:] = decode_attend(states, q_, k_buf, v_buf, layer.scaling,
                              slot_table=self.req_to_token_pool.req_to_token, table_rows=self.table_rows)
        return o

    def support_triton(self):
        return False

    # ---- helpers ---------------------------------------------------------------------------
    def _decode_state(self, row, layer_id, slots, k_buf, v_buf, head) -> NosaDecodeState:
        """The row's state holding every token but the last, caught up from the pool if needed
        (a fresh request, or tokens that went through an extend, e.g. a mixed chunk)."""
        prior = slots.shape[0] - 1
        state = self.states.get(row, layer_id)
        if state is None or state.length > prior:
            state = NosaDecodeState(self.config, k_buf.shape[1], k_buf.shape[2], device=k_buf.device)
            self.states.put(row, layer_id, state)
        if state.length < prior:
            state.append(k_buf, head(v_buf[slots[state.length : prior].long()]), slots=slots[:prior])
        return state

    def _prepare(self, q, k, v, layer, forward_batch, save_kv_cache):
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc), k, v)
        o = q.new_empty((q.shape[0], layer.tp_q_head_num * layer.v_head_dim))
        q_ = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o_ = o.view(-1, layer.tp_q_head_num, layer.v_head_dim)
        k_buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        return o, q_, o_, k_buf, v_buf

    def _check_layer(self, layer) -> None:
        if layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY:
            raise NotImplementedError("nosa backend: only causal decoder self-attention is supported")
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            raise NotImplementedError("nosa backend: sliding-window layers are not supported")
        if layer.tp_k_head_num != self.num_kv_heads:
            raise NotImplementedError(
                f"nosa backend: KV heads are split across tensor-parallel ranks "
                f"({layer.tp_k_head_num} of {self.num_kv_heads}); the eviction head reads all of a "
                "token's value heads, so run with --tp-size 1"
            )
        if layer.qk_head_dim != self.head_dim:
            raise ValueError(f"nosa backend: layer head_dim {layer.qk_head_dim} != config {self.head_dim}")
