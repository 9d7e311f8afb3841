"""NosaAttnBackend: SGLang attention with NOSA block selection, the KV in SGLang's pool or offloaded.

Layout (SGLang's, token-major): q [T, Hq*D] viewed as [T, Hq, D]; k, v [T, Hkv, D] for the T new
tokens of the batch; ``req_to_token[row, :seq_len]`` lists the slots of a request's context.

A thin adapter: the selection, the decode step (select -> resolve -> attend) and the prefill are
nosa's, imported, never re-implemented, so that serving and the HF model pick the same blocks.
What differs between the two modes is only where K, V and cis live, i.e. which KV view (nosa.kv)
the decode state reads through:
- offloading off (default): SGLang's device pool [slots, Hkv, D] plus a cis buffer per layer kept
  here, read in place (``nosa.kv.PagedKV``); extend runs ``nosa_prefill`` over the gathered context
  as before;
- offloading on ($NOSA_OFFLOAD=1, nosa.serve.offload_config): SGLang's pool is the host pool
  (nosa.serve.host_pool); decode resolves through the device block cache (nosa.serve.block_cache),
  extend runs ``NosaDecodeState.prefill``, which reads only the union of each chunk's blocks
  (``nosa.serve.offload_kv.OffloadKV``). With $NOSA_RECALL_SCHEDULER=1 the cache's copies go
  through the recall scheduler and, once layer l's blocks are resolved, layer l + 1's predicted
  blocks are prefetched (nosa.serve.recall_scheduler); with $NOSA_ADMISSION=1 the admission
  controller (nosa.serve.admission) lends slots and holds new requests back. Per-step counters:
  nosa.serve.step_stats.
Per-request state (one ``NosaDecodeState`` per (request row, layer)) lives in
nosa.serve.states.RequestStates, attached to SGLang's ReqToTokenPool so that finishing, aborting
or retracting a request frees it and its device block slots.
Eviction scores cis = A * softplus(W v + b) come from the checkpoint's eviction heads
(nosa.serve.checkpoint); a dense checkpoint has A = 0.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc

from nosa.attention.prefill import nosa_prefill
from nosa.decode import NosaDecodeState, decode_attend
from nosa.kv import PagedKV
from nosa.serve.checkpoint import (
    load_eviction_heads,
    load_nosa_config,
    resolve_model_dir,
    zero_eviction_heads,
)
from nosa.serve.offload_config import OffloadSettings, offload_enabled
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
        self.offload = self._init_offload(model_runner) if offload_enabled() else None
        if self.offload is None:  # cis per pool slot, beside SGLang's K and V
            rows = self.token_to_kv_pool.get_key_buffer(0).shape[0]
            self.cis_pool = [torch.zeros(rows, self.num_kv_heads, device=self.device) for _ in range(self.num_layers)]

    def _init_offload(self, model_runner):
        """Validate the settings, check that the host pool hooks took effect, build the device cache."""
        from nosa.serve import host_pool
        from nosa.serve.block_cache import DeviceBlockCache

        settings = OffloadSettings.from_env()
        settings.validate(self.config, model_runner.server_args.page_size)
        for role in ("prefill_attention_backend", "decode_attention_backend"):
            chosen = getattr(model_runner.server_args, role, None)
            if chosen not in (None, "nosa"):
                flag = "--" + role.replace("_", "-")
                raise ValueError(f"nosa backend: offloading needs nosa for prefill and decode ({flag} {chosen}): "
                                 "other backends cannot read the host pool")
        host_pool.verify(model_runner, settings, self.config)
        pool = self.token_to_kv_pool
        from nosa.serve.step_stats import StepStats

        scheduler = None
        if settings.schedule:
            from nosa.serve.recall_scheduler import RecallScheduler

            scheduler = RecallScheduler(self.num_layers, settings.chunk_items)
        cache = DeviceBlockCache(
            self.num_layers, settings.max_requests(self.config), self.num_kv_heads,
            settings.slots_per_head(self.config), self.config.block_size, self.head_dim, pool.v_head_dim,
            pool.dtype, self.device, scheduler=scheduler, home_slots=settings.home_slots(self.config),
        )
        self.states.on_free.append(cache.release)
        control = self._init_admission(settings, cache, pool) if settings.admission else None
        self.step_stats = StepStats(cache, scheduler, control)
        self._stats_written = 0.0

        def counts():
            out = {"device_slots_in_use": cache.resident_slots(),
                   "offload": {k: list(v) for k, v in cache.stats.items()}, "timeline": self.step_stats.snapshot()}
            if scheduler is not None:
                out["scheduler"] = {k: list(v) for k, v in scheduler.stats.items()}
            if control is not None:
                out["admission"] = control.snapshot()
            return out

        self.states.extra_counts = counts
        return cache

    def _init_admission(self, settings, cache, pool):
        """The admission controller, seeded by a start-up probe of the link (nosa.serve.admission)."""
        from nosa.serve import admission

        admission.verify_hooks()
        cfg = self.config
        control = admission.Admission(
            admission.AdmissionPolicy(max_extra=settings.extra_slots), cache.item_bytes, cfg.topk_blocks,
            bound_items=(cfg.query_blocks + 1) * self.num_kv_heads * self.num_layers)
        bandwidth, nbytes, seconds = admission.probe_bandwidth([cache.k[0], cache.v[0], cache.cis[0]], pool.items(0))
        control.bw = bandwidth
        logger.info("nosa admission: link probe %d bytes in %.6f s = %.2f GB/s", nbytes, seconds, bandwidth / 1e9)
        admission.CONTROLLER = control
        self.states.on_free.append(lambda row: control.forget(row - 1))
        return control

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
        if self.offload is not None:
            for row in rows:  # a starting request takes back its slot columns lent to others
                self.offload.activate(row)
            if forward_batch.forward_mode.is_decode():
                self.step_stats.begin(rows, seq_lens)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self._check_layer(layer)
        o, q_, o_, k_buf, v_buf = self._prepare(q, k, v, layer, forward_batch, save_kv_cache)
        head = self.heads[layer.layer_id]
        self._write_cis(layer.layer_id, v, forward_batch, head)
        start = 0
        view = self._offload_view(layer.layer_id) if self.offload is not None else None
        for i, (row, slots, ext_len) in enumerate(self.forward_metadata):
            if ext_len == 0:
                continue
            rows = slice(start, start + ext_len)
            if view is not None:  # reads only the union of each chunk's blocks from the host pool
                state = self._state(row, layer.layer_id, fresh=slots.shape[0] == ext_len,
                                    max_length=slots.shape[0] - ext_len)
                o_[rows], _ = state.prefill(q_[rows], view, layer.scaling, seq=i)
            else:
                slots = slots.long()
                v_ctx = v_buf[slots].to(q_.dtype)
                o_[rows], _ = nosa_prefill(q_[rows], k_buf[slots].to(q_.dtype), v_ctx, head(v_ctx),
                                           self.config, layer.scaling)
            start += ext_len
        return o

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self._check_layer(layer)
        q = q.reshape(-1, layer.tp_q_head_num * layer.qk_head_dim)
        o, q_, o_, k_buf, v_buf = self._prepare(q, k, v, layer, forward_batch, save_kv_cache)
        head = self.heads[layer.layer_id]
        cis_new = self._write_cis(layer.layer_id, v, forward_batch, head)  # [R, Hkv]
        if self.offload is not None:
            view = self._offload_view(layer.layer_id, new_tokens=(k, v, cis_new))
        else:
            lengths = [slots.shape[0] for _, slots, _ in self.forward_metadata]
            view = PagedKV(k_buf, v_buf, self.cis_pool[layer.layer_id], self.req_to_token_pool.req_to_token,
                           self.table_rows, lengths)
        states = []
        for i, (row, slots, _) in enumerate(self.forward_metadata):
            state = self._state(row, layer.layer_id, fresh=False, max_length=view.length(i) - 1)
            if self.offload is None and state.length < slots.shape[0] - 1:
                # tokens another prefill backend wrote (--prefill-attention-backend torch_native) have no
                # cis yet: compute it from the pool's V for the tokens the state is about to catch up on
                missing = slots[state.length : slots.shape[0] - 1].long()
                self.cis_pool[layer.layer_id][missing] = head(v_buf[missing])
            state.append(view, seq=i)
            states.append(state)
        if self.offload is not None and self.offload.scheduler is not None and layer.layer_id + 1 < self.num_layers:
            view.after_resolve = lambda: self._prefetch(layer.layer_id + 1)
        # the whole batch in one call: select -> resolve (the view) -> attend
        o_[:] = decode_attend(states, q_, view, layer.scaling)
        if self.offload is not None and layer.layer_id == self.num_layers - 1:
            self._end_step()
        return o

    def _prefetch(self, layer_id: int) -> None:
        """Layer ``layer_id``'s predicted blocks start moving while the layer before it attends."""
        from nosa.serve.offload_kv import predicted_blocks

        rows = [row for row, _, _ in self.forward_metadata]
        lengths = [slots.shape[0] for _, slots, _ in self.forward_metadata]
        if not self.offload.may_prefetch(layer_id, rows, lengths):
            return
        states = [self.states.get(row, layer_id) for row in rows]
        if any(s is not None for s in states):
            self._offload_view(layer_id).prefetch(predicted_blocks(states, lengths, self.config))

    def _end_step(self) -> None:
        import time

        self.step_stats.end()
        if time.monotonic() - self._stats_written > 1.0:  # the dashboard's file, at most once a second
            self._stats_written = time.monotonic()
            self.states.write_stats()

    def support_triton(self):
        return False

    # ---- helpers ---------------------------------------------------------------------------
    def _state(self, row, layer_id, fresh: bool, max_length: int | None = None) -> NosaDecodeState:
        """The row's state; a new one for a fresh request or when the stored one is ahead of
        ``max_length`` (the row was reused)."""
        state = None if fresh else self.states.get(row, layer_id)
        if state is None or (max_length is not None and state.length > max_length):
            state = NosaDecodeState(self.config, self.num_kv_heads, self.head_dim, device=self.device)
            self.states.put(row, layer_id, state)
        return state

    def _write_cis(self, layer_id, v, forward_batch, head):
        """cis of the batch's new tokens, computed from V as the pool stores it, into the cis pool."""
        loc = forward_batch.out_cache_loc
        cis = head(v.view(-1, self.num_kv_heads, self.head_dim).to(self.token_to_kv_pool.dtype))
        if self.offload is not None:
            self.token_to_kv_pool.set_cis(layer_id, loc, cis)
        else:
            self.cis_pool[layer_id][loc.long()] = cis
        return cis

    def _offload_view(self, layer_id, new_tokens=None):
        from nosa.serve.offload_kv import OffloadKV

        rows = [row for row, _, _ in self.forward_metadata]
        lengths = [slots.shape[0] for _, slots, _ in self.forward_metadata]
        if new_tokens is not None:
            k, v, cis = new_tokens
            new_tokens = (k.view(-1, self.num_kv_heads, self.head_dim), v.view(-1, self.num_kv_heads, v.shape[-1]), cis)
        return OffloadKV(self.token_to_kv_pool, self.offload, layer_id, self.req_to_token_pool.req_to_token,
                         rows, lengths, self.device, new_tokens)

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
