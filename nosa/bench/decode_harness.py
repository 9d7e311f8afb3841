"""The serving backend's decode step over plain tensors laid out as SGLang lays out its pools, without
SGLang: for the compile test (tests/serve/test_decode_graph.py), the GPU check's capture and replay
(scripts/graph_check.py) and scripts/bench_resolve.py.

``DecodeHarness(cfg, lengths, offload=...)`` builds what the nosa backend builds at start-up: a
token-slot KV pool (offloading on: the page-major host pool and the device block cache), shuffled
``req_to_token`` rows, eviction heads with A != 0, the request registry, its StatePool and the
DecodeRunner. Per step: ``begin(rows)`` (the host half), ``forward(q, k, v)`` (the device half, what
a graph captures: q [R, L, Hq, D], k, v [R, L, Hkv, D] -> out [R, L, Hq, D]), ``new_tokens(step)``
(the step's inputs, the same for the same seed and step).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from nosa import kvquant
from nosa.config import NosaConfig
from nosa.eviction import EvictionHead
from nosa.kvquant import QuantizedItems
from nosa.serve.decode_runner import DecodeRunner, PoolResolver
from nosa.serve.metadata import ForwardMetadata
from nosa.serve.offload.block_cache import DeviceBlockCache
from nosa.serve.offload.engine import OffloadEngine
from nosa.serve.offload.kv import TokenRowMemo, write_kv_rows
from nosa.serve.registry import RequestRegistry
from nosa.state_pool import StatePool, pages_for


class _TokenPool:
    """K and V [slots, Hkv, D] per layer, as SGLang's MHATokenToKVPool hands them out."""

    def __init__(self, k, v):
        self.k_buffer, self.v_buffer = k, v

    def get_key_buffer(self, layer: int) -> torch.Tensor:
        return self.k_buffer[layer]

    def get_value_buffer(self, layer: int) -> torch.Tensor:
        return self.v_buffer[layer]


class _ExactPrompts:
    """The offload engine, whose views read a prompt's keys exact (``OffloadKV.exact_keys``): with a
    quantized host pool the server builds the prompt's compressed keys in its prefill, from the
    model's keys, so a state catching up on the prompt here must read those too."""

    def __init__(self, engine, req_to_token: torch.Tensor, prompt_k: list[torch.Tensor]):
        self._engine, self._req_to_token, self._prompt_k = engine, req_to_token, prompt_k

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def view(self, layer: int, metadata: ForwardMetadata, *args, **kwargs):
        view = self._engine.view(layer, metadata, *args, **kwargs)
        for i, (row, length) in enumerate(zip(metadata.rows, metadata.lengths)):
            slots = self._req_to_token[row, :length].long().cpu()
            view.exact_keys[i] = (0, self._prompt_k[layer][slots].to(view.device))
        return view


class _HostPool:
    """The page-major host pool of nosa.serve.offload.host_pool.HostKVPool: K, V [P, Hkv, B, D] and
    cis [P, Hkv, B] per layer (pinned on CUDA); item ``page * Hkv + h``."""

    def __init__(self, k, v, cis, page_size: int, kv_dtype: torch.dtype | None = None,
                 key_factors: list[torch.Tensor] | None = None):
        """``kv_dtype``: a quantized pool's K/V dtype (NOSA_HOST_KV_DTYPE), K and V given in the model's;
        ``key_factors``: an int8 pool's key factors [Hkv, D] per layer (HostKVPool.set_key_factors)."""
        self.page_size, self.head_num, self.cis_buffer = page_size, k[0].shape[1], cis
        self.k_scale = self.v_scale = None
        self.key_factors = key_factors
        model_dtype = k[0].dtype
        if kv_dtype is not None:  # quantized as HostKVPool.set_kv_buffer writes them: per token and head
            pinned = k[0].is_pinned()
            kf = key_factors or [None] * len(k)  # K pages [P, Hkv, B, D]: a head's factors over its tokens
            pairs = [[kvquant.quantize(t, kv_dtype, factor=None if f is None else f[:, None, :])
                      for t, f in zip(k, kf)], [kvquant.quantize(t, kv_dtype) for t in v]]
            pin = (lambda t: t.pin_memory()) if pinned else (lambda t: t)
            (k, self.k_scale), (v, self.v_scale) = ([[pin(p[j]) for p in ps] for j in (0, 1)] for ps in pairs)
        self.k_buffer, self.v_buffer = k, v
        self._items = []
        for layer in range(len(k)):
            ki, vi = k[layer].flatten(0, 1), v[layer].flatten(0, 1)
            if kv_dtype is not None:
                factor = None if key_factors is None else key_factors[layer]
                ki = QuantizedItems(ki, self.k_scale[layer].flatten(0, 1), model_dtype, factor)
                vi = QuantizedItems(vi, self.v_scale[layer].flatten(0, 1), model_dtype)
            self._items.append((ki, vi, cis[layer].flatten(0, 1)))
        self.quantized = kv_dtype is not None
        self.token_rows = TokenRowMemo(page_size, self.head_num)  # as HostKVPool: once per forward

    def items(self, layer: int):
        return self._items[layer]


class DecodeHarness:
    def __init__(self, cfg: NosaConfig, lengths: list[int], offload: bool = False, device="cpu", num_layers: int = 2,
                 hq: int = 4, hkv: int = 2, head_dim: int = 16, new_tokens: int = 64, seed: int = 0,
                 host_kv_dtype: torch.dtype | None = None, max_context: int | None = None,
                 key_factors: list[torch.Tensor] | None = None):
        self.cfg, self.device, self.num_layers, self.offload = cfg, torch.device(device), num_layers, offload
        self.hq, self.hkv, self.d, self.seed = hq, hkv, head_dim, seed
        self.lengths = list(lengths)  # prompt lengths; each step adds one token
        rows = len(lengths) + 1  # row 0: SGLang's padding row
        max_context = max(max(lengths) + new_tokens + 1, max_context or 0)  # the server's longest context
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.heads = [EvictionHead(hkv, head_dim).to(self.device) for _ in range(num_layers)]
        with torch.no_grad():
            for head in self.heads:
                head.scale.copy_(torch.rand(hkv, generator=g) + 0.5)
        # each request's slots, shuffled; slot / page 0 is the padding slot
        block = cfg.block_size
        pages = [cfg.num_blocks(max_context) for _ in lengths]
        order = torch.randperm(sum(pages), generator=g) + 1
        self.req_to_token = torch.zeros(rows, max_context, dtype=torch.int32)
        start = 0
        for i, n in enumerate(pages):
            own = order[start : start + n]
            start += n
            self.req_to_token[i + 1] = (own[:, None] * block + torch.arange(block)).flatten()[:max_context].int()
        self.req_to_token = self.req_to_token.to(self.device)
        num_slots = (sum(pages) + 1) * block
        prompt_k = [torch.randn(num_slots, hkv, head_dim, generator=g) for _ in range(num_layers)]
        prompt_v = [torch.randn(num_slots, hkv, head_dim, generator=g) for _ in range(num_layers)]
        with torch.no_grad():
            prompt_cis = [head(v.to(self.device)).float() for head, v in zip(self.heads, prompt_v)]
        registry = RequestRegistry(SimpleNamespace(req_generation=[0] * rows), num_layers, num_slots,
                                   StatePool(cfg, num_layers, rows, hkv, head_dim, max_context,
                                             pages_for(cfg, num_slots, rows), torch.float32, self.device,
                                             key_tails=offload))
        self.states = registry
        if offload:
            def host(x):  # [slots, Hkv, ...] -> page-major [P, Hkv, B, ...]
                x = x.view(-1, block, *x.shape[1:]).transpose(1, 2).contiguous()
                return x.pin_memory() if self.device.type == "cuda" else x

            self.pool = _HostPool([host(k) for k in prompt_k], [host(v) for v in prompt_v],
                                  [host(c.cpu()) for c in prompt_cis], block, host_kv_dtype, key_factors)
            cache = DeviceBlockCache(num_layers, rows - 1, hkv, cfg.topk_blocks, block, head_dim, head_dim,
                                     torch.float32, self.device)
            runner = SimpleNamespace(token_to_kv_pool=self.pool, req_to_token_pool=SimpleNamespace(
                req_to_token=self.req_to_token), device=self.device)
            self.engine = OffloadEngine(runner, cfg, cache)
            registry.attach_offload(self.engine)
            kv, spare = self.engine, cache.spare_group
            if host_kv_dtype is not None:  # the server prefills from the exact keys, not the pool's
                kv = _ExactPrompts(self.engine, self.req_to_token, prompt_k)
        else:
            self.pool = _TokenPool([k.to(self.device) for k in prompt_k], [v.to(self.device) for v in prompt_v])
            self.cis = prompt_cis
            kv, spare = PoolResolver(self.pool, self.cis, self.req_to_token, self.heads, block), None
        self.decode = DecodeRunner(cfg, num_layers, registry, registry.pool, kv, self.device, spare)
        # the graph runner's own static inputs: rows, lengths and new-token slots of a batch
        self.runner_rows = torch.zeros(rows - 1, dtype=torch.long, device=self.device)
        self.runner_lengths = torch.ones(rows - 1, dtype=torch.long, device=self.device)
        self.runner_loc = torch.zeros(rows - 1, dtype=torch.long, device=self.device)

    def init_graph_state(self) -> None:
        """As init_cuda_graph_state / init_cpu_graph_state: the largest batch is every request."""
        self.decode.init_graph_state(len(self.lengths))

    def new_tokens(self, step: int):
        """q [R, L, Hq, D], k and v [R, L, Hkv, D] of step ``step`` (the same for the same seed)."""
        g = torch.Generator().manual_seed(self.seed * 1000 + step)
        r, layers = len(self.lengths), self.num_layers
        q = torch.randn(r, layers, self.hq, self.d, generator=g)
        k, v = (torch.randn(r, layers, self.hkv, self.d, generator=g) for _ in range(2))
        return q.to(self.device), k.to(self.device), v.to(self.device)

    # ---- host half ---------------------------------------------------------------------------
    @torch.no_grad()
    def begin(self, rows: list[int]) -> None:
        """The step of requests ``rows`` (1-based; 0 = a padding row) each one token longer than its
        last step (its prompt + 1 for the first), written into the runner's inputs; the host half."""
        lengths = [self.lengths[r - 1] + 1 if r else 1 for r in rows]
        groups_of = self.engine.groups_of if self.offload else None
        metadata = ForwardMetadata.decode_of(rows, lengths, self.req_to_token, groups_of)
        self.states.pool.recycle()
        warm = self.engine.begin(metadata) if self.offload else None
        self.decode.prepare(metadata, warm)
        n = len(rows)
        self.runner_rows[:n].copy_(torch.tensor(rows))
        self.runner_lengths[:n].copy_(torch.tensor(lengths))
        self.runner_loc[:n].copy_(torch.tensor([int(self.req_to_token[r, m - 1]) if r else 0
                                                for r, m in zip(rows, lengths)]))
        for r, m in zip(rows, lengths):
            if r:
                self.lengths[r - 1] = m

    # ---- device half: what a graph captures --------------------------------------------------
    @torch.no_grad()
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """init_forward_metadata_in_graph + every layer's forward_decode for the batch of ``begin``."""
        n = q.shape[0]
        self.decode.fill(self.runner_rows[:n], self.runner_lengths[:n])
        loc = self.runner_loc[:n]
        outs = []
        for layer in range(self.num_layers):
            k_l, v_l = k[:, layer], v[:, layer]
            cis = self.heads[layer](v_l)
            self._store(layer, loc, k_l, v_l, cis)
            outs.append(self.decode.run_layer(layer, q[:, layer], k_l, v_l, cis, self.d**-0.5))
        return torch.stack(outs, dim=1)

    def _store(self, layer: int, loc: torch.Tensor, k, v, cis) -> None:
        """The new tokens into the KV pool (SGLang's set_kv_buffer; the host pool's write on offload)."""
        if not self.offload:
            self.pool.k_buffer[layer][loc] = k
            self.pool.v_buffer[layer][loc] = v
            self.cis[layer][loc] = cis.float()
            return
        k_items, v_items, cis_items = self.pool.items(layer)
        d = self.d
        write_kv_rows(k_items, v_items, k.reshape(-1, d), v.reshape(-1, d), self.pool.token_rows(loc).flatten(),
                      extra=([cis_items.view(-1, 1)], [cis.float().reshape(-1, 1)]))
