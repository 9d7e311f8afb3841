"""The host KV pool: SGLang's logical KV pool, kept in host memory, and the hooks that install it.

With offloading, SGLang's allocator ids are host slots and its pool is sized to $NOSA_HOST_KV_TOKENS,
so its scheduler, chunked prefill, length limits and leak checks work unchanged against host memory.
Layout per layer (SGLang's "HND", one page = one NOSA block): K, V [P, Hkv, B, D] and cis [P, Hkv, B]
float32; item ``page * Hkv + h`` of the [P * Hkv, B, D] view is one (block, KV head), the unit
nosa.ops.copy_items moves; token slot ``s`` is page ``s // B``, offset ``s % B``. Only the layers with
NOSA attention have buffers (a hybrid model's sliding-window layers keep their window on the device:
nosa.serve.window), indexed 0..n-1 in layer order: ``items(i)`` takes that index. On CUDA the buffers
are pinned in chunks, so the recall kernel reads them directly. ``register_hooks`` (the plugin, every
process) hooks the pool class, its size and the cap on running requests (the device budget's
``max_requests``); ``verify`` checks at start-up that each took effect.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, unwrap_write_loc
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from nosa import kv_calibrate, kvquant
from nosa.checkpoint_format import nosa_layers
from nosa.kvquant import QuantizedItems
from nosa.serve.checkpoint import load_nosa_config, resolve_model_dir
from nosa.serve.offload.kv import TokenRowMemo, write_kv_rows, write_token_rows
from nosa.serve.offload.settings import OffloadSettings, backend_errors, check_host_memory

logger = logging.getLogger(__name__)

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
PIN_CHUNK_BYTES = 1 << 30  # cudaHostRegister in 1 GiB pieces


class HostKVPool(MHATokenToKVPool):
    """MHATokenToKVPool whose buffers live in host memory, in the page-major HND layout, plus cis."""

    # SGLang reads $SGLANG_USE_HND_KVCACHE into ``use_hnd`` in __init__; this pool is always HND.
    use_hnd = property(lambda self: True, lambda self, value: None)
    nosa_layer_ids: tuple[int, ...] | None = None  # the model's layers with NOSA attention (None: all)
    host_kv_dtype_name: str = "auto"  # $NOSA_HOST_KV_DTYPE (nosa.kvquant)
    key_factors: list[torch.Tensor] | None = None  # int8 keys' factors [Hkv, D] per NOSA layer (set_key_factors)

    def _create_buffers_normal(self):
        mine = range(self.start_layer, self.start_layer + self.layer_num)
        ids = [i for i in mine if self.nosa_layer_ids is None or i in self.nosa_layer_ids]
        self.nosa_index = {layer_id: n for n, layer_id in enumerate(ids)}  # SGLang layer id -> buffer
        layers = len(self.nosa_index)
        shape = (self.num_pages, self.head_num, self.page_size)
        with backend_errors():
            self.kv_dtype = kvquant.host_kv_dtype(self.host_kv_dtype_name, self.dtype)  # what K and V are stored in
        self.quantized = kvquant.is_quantized(self.kv_dtype)
        nbytes = layers * self.num_pages * self.head_num * self.page_size * self.bytes_per_token_head
        check_host_memory(nbytes, f"{layers} layers x {self.num_pages} pages of {self.page_size} tokens"
                                  f" ({self.kv_dtype})")
        store = self.kv_dtype if self.quantized else self.store_dtype
        self.k_buffer = [torch.zeros(*shape, self.head_dim, dtype=store) for _ in range(layers)]
        self.v_buffer = [torch.zeros(*shape, self.v_head_dim, dtype=store) for _ in range(layers)]
        self.cis_buffer = [torch.zeros(shape, dtype=torch.float32) for _ in range(layers)]
        scales = [torch.zeros(shape, dtype=kvquant.SCALE_DTYPE) for _ in range(2 * layers if self.quantized else 0)]
        self.k_scale, self.v_scale = scales[:layers], scales[layers:]
        if torch.device(self.device).type == "cuda":
            for buf in (*self.k_buffer, *self.v_buffer, *self.cis_buffer, *scales):
                _pin(buf)

    @property
    def bytes_per_token_head(self) -> int:
        """Host bytes of one token of one KV head in one layer: K, V (their scales when quantized), cis."""
        return kvquant.bytes_per_token(self.head_dim, self.v_head_dim, self.kv_dtype)

    # ---- item views (what the recall engine copies) -------------------------------------------
    def items(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k [P*Hkv, B, D], v [P*Hkv, B, Dv], cis [P*Hkv, B]) of NOSA layer i (the i-th layer with
        NOSA attention); item = page * Hkv + h. The views are made once per layer (several calls
        per layer and step)."""
        views = getattr(self, "_item_views", {}).get(i)
        if views is None or views[2].data_ptr() != self.cis_buffer[i].data_ptr():
            k, v = self.k_buffer[i].flatten(0, 1), self.v_buffer[i].flatten(0, 1)
            if self.quantized:  # recalls dequantize them into the device cache (nosa.ops.copy_items)
                factor = None if self.key_factors is None else self.key_factors[i]
                k = QuantizedItems(k, self.k_scale[i].flatten(0, 1), self.dtype, factor)
                v = QuantizedItems(v, self.v_scale[i].flatten(0, 1), self.dtype)
            views = (k, v, self.cis_buffer[i].flatten(0, 1))
            self.__dict__.setdefault("_item_views", {})[i] = views
        return views

    def set_key_factors(self, factors: list[torch.Tensor]) -> None:
        """Install the int8 keys' factors (nosa.kvquant; [Hkv, D] per NOSA layer, this rank's heads),
        before any token is written: every key is then quantized and recalled with them."""
        if self.kv_dtype != torch.int8:
            raise ValueError(f"nosa offloading: key factors apply to an int8 host pool, not {self.kv_dtype}")
        want = (self.head_num, self.head_dim)
        if len(factors) != len(self.k_buffer) or any(tuple(f.shape) != want for f in factors):
            raise ValueError(f"nosa offloading: expected {len(self.k_buffer)} key factor tables of shape {want}, got "
                             f"{[tuple(f.shape) for f in factors]}")
        self.key_factors = [f.to(self.device, torch.float32).contiguous() for f in factors]
        self.__dict__.pop("_item_views", None)  # the items carry them

    def token_rows(self, loc: torch.Tensor) -> torch.Tensor:
        """[T] token slots -> [T, Hkv] rows of the [P*Hkv*B, D] view (row of token s, head h); once
        per forward (nosa.serve.offload.kv.TokenRowMemo). The rows are shared: read them only."""
        memo = self.__dict__.get("_token_rows")
        if memo is None:
            memo = self._token_rows = TokenRowMemo(self.page_size, self.head_num)
        return memo(loc)

    # ---- writes ------------------------------------------------------------------------------
    def set_kv_buffer(self, layer, loc_info, cache_k, cache_v, k_scale=None, v_scale=None,
                      layer_id_override=None, dcp_kv_mask=None):
        """K/V of new tokens [T, Hkv, D] into their host slots (one scatter per tensor)."""
        if k_scale is not None or v_scale is not None or dcp_kv_mask is not None:
            raise NotImplementedError("nosa offloading: scaled or masked KV writes are not supported")
        loc, _, _ = unwrap_write_loc(loc_info)
        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        if layer_id not in self.nosa_index:
            raise ValueError(f"nosa offloading: layer {layer_id} has no host KV (a sliding-window layer keeps its "
                             "window on the device, nosa.serve.window)")
        k_items, v_items, _ = self.items(self.nosa_index[layer_id])
        write_kv_rows(k_items, v_items, cache_k.to(self.dtype).reshape(-1, self.head_dim),
                      cache_v.to(self.dtype).reshape(-1, self.v_head_dim), self.token_rows(loc).flatten())

    def set_cis(self, i: int, loc: torch.Tensor, cis: torch.Tensor) -> None:
        """Eviction scores of new tokens [T, Hkv] of NOSA layer i into their host slots."""
        _, _, cis_items = self.items(i)
        write_token_rows([cis_items.view(-1, 1)], [cis.float().reshape(-1, 1)], self.token_rows(loc).flatten())

    def get_cpu_copy(self, *args, **kwargs):
        raise NotImplementedError("nosa offloading: the KV already lives in host memory (no CPU copy path)")

    def load_cpu_copy(self, *args, **kwargs):
        raise NotImplementedError("nosa offloading: the KV already lives in host memory (no CPU copy path)")


def install_key_factors(pool, model_dir: str, layers: list[int], shard) -> str:
    """An int8 host pool's key factors (nosa.kvquant: the checkpoint's KEY_FACTORS_FILE, written by
    ``python -m nosa.kv_calibrate``), for the NOSA ``layers`` and this rank's KV heads (``shard``:
    nosa.serve.parallel.KVHeadShard; SGLang's padding heads get ones). Returns what it did, for the
    log. Without the file the keys keep one scale per token; a file that does not fit the model is an
    error naming it."""
    if getattr(pool, "kv_dtype", None) != torch.int8:
        return "no key factors (not an int8 host pool)"
    with backend_errors():
        factors = kv_calibrate.load_key_factors(model_dir)
    if factors is None:
        logger.warning("nosa offloading: %s has no %s: int8 keys are scaled per token only, which costs accuracy on "
                       "keys with outlier channels; write it with: python -m nosa.kv_calibrate %s",
                       model_dir, kvquant.KEY_FACTORS_FILE, model_dir)
        return "no key factors (none in the checkpoint)"
    tables = []
    for layer in layers:
        f = factors.get(layer)
        if f is None or tuple(f.shape) != (shard.real, pool.head_dim):
            got = "none" if f is None else tuple(f.shape)
            raise ValueError(f"nosa offloading: {model_dir}/{kvquant.KEY_FACTORS_FILE}: layer {layer} needs key "
                             f"factors [{shard.real}, {pool.head_dim}], found {got}; rerun python -m nosa.kv_calibrate")
        ones = torch.ones(pool.head_dim)
        tables.append(torch.stack([f[h] if h < shard.real else ones for h in shard.heads()]))
    pool.set_key_factors(tables)
    return f"int8 key factors from {kvquant.KEY_FACTORS_FILE}"


def _pin(buf: torch.Tensor) -> None:
    """Register a host tensor as pinned memory, in chunks (a single huge registration can fail)."""
    cudart = torch.cuda.cudart()
    flat = buf.view(-1).view(torch.uint8)
    for start in range(0, flat.numel(), PIN_CHUNK_BYTES):
        piece = flat[start : start + PIN_CHUNK_BYTES]
        err = cudart.cudaHostRegister(piece.data_ptr(), piece.numel(), 0)
        if int(err) != 0:
            raise RuntimeError(f"nosa offloading: cudaHostRegister failed ({err}) on {piece.numel()} bytes")


# ---- hooks ----------------------------------------------------------------------------------
def register_hooks(settings: OffloadSettings) -> None:
    """Install the host pool through SGLang's HookRegistry (called by the plugin in every process)."""
    def pool_class(original, self, *, kind, default):
        cls = original(self, kind=kind, default=default)
        if kind != "mha" or cls is not MHATokenToKVPool:
            return cls
        layers = tuple(nosa_layers(self.model_config.hf_text_config))
        return type(HostKVPool.__name__, (HostKVPool,), {"nosa_layer_ids": layers, "__module__": __name__,
                                                         "host_kv_dtype_name": settings.host_kv_dtype})

    def profile(original, self, *args, **kwargs):
        # the pool lives in host memory: device memory does not bound it (RAM is checked on allocation)
        return max(original(self, *args, **kwargs), 1 << 50)

    def token_cap(original, self, token_capacity):
        return min(original(self, token_capacity), settings.host_tokens)

    def max_requests(original, self, token_capacity):
        cfg, _ = load_nosa_config(resolve_model_dir(self.model_config.model_path))
        return min(original(self, token_capacity), settings.max_requests(cfg))

    HookRegistry.register(f"{_CONFIGURATOR}._resolve_kv_pool_class", pool_class, HookType.AROUND)
    HookRegistry.register(f"{_CONFIGURATOR}._profile_available_bytes", profile, HookType.AROUND)
    HookRegistry.register(f"{_CONFIGURATOR}._apply_token_constraints", token_cap, HookType.AROUND)
    HookRegistry.register(f"{_CONFIGURATOR}.resolve_max_num_reqs", max_requests, HookType.AROUND)


def verify(model_runner, settings: OffloadSettings, cfg) -> None:
    """Start-up check that every hook took effect; raises naming the one that did not."""
    pool = model_runner.token_to_kv_pool
    if not isinstance(pool, HostKVPool):
        raise RuntimeError(
            f"nosa offloading: SGLang built a {type(pool).__name__}, not the host pool; the KV-pool hook "
            f"({_CONFIGURATOR}._resolve_kv_pool_class) did not take effect with this SGLang version"
        )
    if pool.size > settings.host_tokens:
        raise RuntimeError(
            f"nosa offloading: the KV pool holds {pool.size} tokens, more than $NOSA_HOST_KV_TOKENS="
            f"{settings.host_tokens}; the sizing hook ({_CONFIGURATOR}._apply_token_constraints) did not take effect"
        )
    max_reqs = model_runner.req_to_token_pool.size
    if max_reqs > settings.max_requests(cfg):
        raise RuntimeError(
            f"nosa offloading: SGLang may run {max_reqs} requests at once but the device budget holds "
            f"{settings.max_requests(cfg)}; the hook {_CONFIGURATOR}.resolve_max_num_reqs did not take effect"
        )
    # per process: with tensor parallelism every rank holds these tokens for its own KV heads only
    logger.info("nosa offloading: host pool %d tokens x %d KV heads (%d pages), device budget %d tokens = %d requests",
                pool.size, pool.head_num, pool.num_pages, settings.device_tokens, settings.max_requests(cfg))
