"""The "nosa" attention of transformers models: the attention function and the eviction heads it reads.

``add_eviction_heads`` gives every full-attention module an ``EvictionHead`` (``nosa_evict``) and
the NosaConfig (a hybrid model's sliding-window layers, Gemma 3's, get none and keep SDPA over their
window: ``nosa_attention_modules`` lists the layers NOSA selects in); ``register`` makes "nosa" a
transformers attention implementation (with the SDPA mask function, so padding reaches us); the NOSA
model classes (nosa.hf_models) use both. Per sequence, in the layout of nosa.layout:
prefill/training rows go through ``nosa_prefill`` (the spec), single-token decode rows through a
``NosaDecodeState`` per (layer, batch row), checked against the cache on every step (a stale state
is rebuilt, not trusted). Packed rows: pass ``position_ids`` that restart at 0 per document and
``use_cache=False``: each document attends only to itself (``nosa_prefill_varlen``), as
transformers' dense mask from the same position_ids. ``capture_attention_inputs(model)`` records
each layer's q/k/v for analysis (nosa.train.metrics).
"""

from __future__ import annotations

import contextlib

import torch

from nosa.attention.math import dense_attention
from nosa.attention.prefill import nosa_prefill, nosa_prefill_varlen
from nosa.checkpoint_format import MODEL_TYPES, nosa_layers
from nosa.config import CONFIG_KEY, NosaConfig
from nosa.decode import NosaDecodeState
from nosa.eviction import MODULE_NAME, EvictionHead
from nosa.kv import ContiguousKV
from nosa.kvquant import roundtrip

ATTN_IMPLEMENTATION = "nosa"
SUPPORTED_MODEL_TYPES = tuple(MODEL_TYPES)  # llama, qwen2, qwen3, gemma3_text: the base models NOSA extends


def register() -> None:
    """Register the "nosa" attention (and its mask function) with transformers. Idempotent."""
    from transformers import AttentionInterface  # cycle: transformers' auto -> nosa.hf_models -> nosa.hf
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # cycle: as above

    AttentionInterface.register(ATTN_IMPLEMENTATION, nosa_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


def nosa_attention_modules(model) -> list[tuple[str, object]]:
    """(name, module) of every attention module NOSA selects in: those with an eviction head, in
    layer order (all of a Llama's; a Gemma 3's full-attention layers only)."""
    return [(name, m) for name, m in model.named_modules() if name.endswith("self_attn") and hasattr(m, MODULE_NAME)]


def add_eviction_heads(model, config: NosaConfig) -> None:
    """Give every full-attention module of a Llama / Qwen2 / Qwen3 / Gemma 3 model an eviction head
    (W, b and A = 0, so attention starts as training-free NOSA selection) where it lacks one, and
    ``config``; store ``config`` in ``model.config.nosa``. Sliding-window layers
    (nosa.checkpoint_format.nosa_layers, the one rule the server reads too) get neither: their KV is
    bounded by the window already. The heads take the device and dtype of ``k_proj``."""
    num_kv = model.config.num_key_value_heads
    full = set(nosa_layers(model.config))
    for i, attn in enumerate(_attention_modules(model)):
        if i not in full:
            continue
        if getattr(attn, "attn_logit_softcapping", None) is not None:
            raise ValueError(
                f"nosa: {type(attn).__name__} soft-caps its attention logits "
                f"(attn_logit_softcapping={attn.attn_logit_softcapping}); NOSA attention does not implement it"
            )
        if not hasattr(attn, MODULE_NAME):
            ref = attn.k_proj.weight
            setattr(attn, MODULE_NAME, EvictionHead(num_kv, attn.head_dim, device=ref.device, dtype=ref.dtype))
        attn._nosa_config = config
    setattr(model.config, CONFIG_KEY, config.to_dict())


def nosa_config_of(hf_config, source: str = "the model config") -> NosaConfig | None:
    """The NosaConfig stored in a transformers config, or in a config.json read as a dict (None for
    a dense checkpoint). A malformed section raises ValueError naming ``source`` and the problem."""
    data = hf_config.get(CONFIG_KEY) if isinstance(hf_config, dict) else getattr(hf_config, CONFIG_KEY, None)
    if data is None:
        return None
    try:
        return NosaConfig.from_dict(data)
    except (TypeError, ValueError) as err:
        raise ValueError(f"malformed '{CONFIG_KEY}' section in {source}: {err}") from err


def nosa_attention_forward(
    module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    position_ids: torch.Tensor | None = None,
    **kwargs,
):
    """transformers attention function. query [B, Hq, S, D]; key/value [B, Hkv, L, D] (the whole
    cache); attention_mask: None or the SDPA mask [B, 1, S, L] (bool, or float with -inf);
    position_ids [B, S] or [1, S]: where they restart, a new document starts (only without a cached
    prefix, S == L). Returns ([B, S, Hq, D], None)."""
    if not hasattr(module, MODULE_NAME):  # a sliding-window layer: the base model's attention, unchanged
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # cycle: as register's

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:
        raise ValueError("NOSA attention does not implement attention dropout; set attention_dropout=0")
    query, key, value = common_dtype(query, key, value)
    cfg: NosaConfig = module._nosa_config
    evict: EvictionHead = getattr(module, MODULE_NAME)
    bsz, hq, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    scale = scaling if scaling is not None else head_dim**-0.5
    valid = _valid_keys(attention_mask, bsz, kv_len, query.device)  # [B, L] bool
    capture = module.__dict__.get("_nosa_capture")
    if capture is not None:
        capture(query, key, value)

    states: dict[int, NosaDecodeState] = module.__dict__.setdefault("_nosa_states", {})
    host_dtype = None if module.training else module.__dict__.get("_nosa_host_kv")  # host_kv_dtype(): (dtype, factor)
    if q_len > 1:
        states.clear()  # a new prefill starts new sequences
    if attention_mask is None and q_len == kv_len and (q_len > 1 or module.training):
        # no padding, no cache (training): every row is real, no gathers or scatters needed
        outs = []
        for b in range(bsz):
            q_rows, k_seq, v_seq = (t[b].transpose(0, 1) for t in (query, key, value))
            docs = _document_bounds(position_ids, b, None)
            attend_kv = _as_host_pool_returns(k_seq, v_seq, host_dtype)
            if docs is None and kv_len <= cfg.dense_len:  # every row dense: no selection to compute
                outs.append(dense_attention(q_rows, *(attend_kv or (k_seq, v_seq)), scale))
            elif docs is None:
                outs.append(nosa_prefill(q_rows, k_seq, v_seq, evict(v_seq), cfg, scale, attend_kv=attend_kv)[0])
            else:
                outs.append(nosa_prefill_varlen(q_rows, k_seq, v_seq, evict(v_seq), docs, cfg, scale)[0])
        return torch.stack(outs), None
    out = query.new_zeros(bsz, q_len, hq, value.shape[-1])
    for b in range(bsz):
        keep = valid[b].nonzero().squeeze(1)
        rows = keep[keep >= kv_len - q_len] - (kv_len - q_len)  # query rows that are real tokens
        if rows.numel() == 0:
            continue
        if rows[0] != q_len - rows.numel() or keep.numel() and keep[-1] != kv_len - q_len + rows[-1]:
            raise ValueError("NOSA attention supports left or right padding only (real tokens contiguous)")
        k_seq = key[b].index_select(1, keep).transpose(0, 1)  # [n, Hkv, D]
        v_seq = value[b].index_select(1, keep).transpose(0, 1)
        q_rows = query[b, :, rows].transpose(0, 1)  # [r, Hq, D]
        if q_len == 1 and not module.training:
            out[b, rows] = _decode(states, b, q_rows[0], k_seq, v_seq, evict, cfg, scale, host_dtype)[None]
            continue
        docs = _document_bounds(position_ids, b, rows) if rows.numel() == keep.numel() else None
        if docs is None:
            o, _ = nosa_prefill(q_rows, k_seq, v_seq, evict(v_seq), cfg, scale,
                                attend_kv=_as_host_pool_returns(k_seq, v_seq, host_dtype))
        else:
            o, _ = nosa_prefill_varlen(q_rows, k_seq, v_seq, evict(v_seq), docs, cfg, scale)
        out[b, rows] = o
    return out, None


def common_dtype(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k and v in one dtype, as SDPA (an autocast op) receives them: under autocast (mixed-precision
    training, e.g. HF Trainer's bf16) its dtype, where transformers' rotary embedding leaves q and k in
    float32 while v comes out of its projection in bf16; otherwise the widest of the three. The
    kernels take one dtype for all three."""
    device = query.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
    else:
        dtype = torch.promote_types(torch.promote_types(query.dtype, key.dtype), value.dtype)
    return query.to(dtype), key.to(dtype), value.to(dtype)


@contextlib.contextmanager
def capture_attention_inputs(model, batch_row: int | None = 0, detach: bool = True):
    """Record the attention inputs of every NOSA layer of ``model`` (``nosa_attention_modules``) while active.

    Yields a dict, filled as the model runs: attention module name (``model.layers.0.self_attn``)
    -> (q [S, Hq, D], k [L, Hkv, D], v [L, Hkv, D]) of batch row ``batch_row`` (None: every row,
    [B, S, Hq, D] ...), after RoPE, the cache included; detached unless ``detach=False`` (a loss on
    them: nosa.train.select_loss). Only attributes of these modules are touched, and removed on
    exit: outputs do not change and transformers' global attention registry is left alone."""
    captured: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
    modules = nosa_attention_modules(model)
    if not modules:
        raise ValueError(f"capture_attention_inputs: {type(model).__name__} is not a NOSA model (nosa.convert it)")

    def hook(name):
        def store(query, key, value):
            rows = (t.transpose(-3, -2) if batch_row is None else t[batch_row].transpose(0, 1)
                    for t in (query, key, value))
            captured[name] = tuple(t.detach() if detach else t for t in rows)
        return store

    for name, m in modules:
        m._nosa_capture = hook(name)
    try:
        yield captured
    finally:
        for _, m in modules:
            m.__dict__.pop("_nosa_capture", None)


def _decode(states, b, q, k_seq, v_seq, evict, cfg, scale, host_dtype=None) -> torch.Tensor:
    """One decode step of batch row b, reusing its state when it still describes this cache.
    ``host_dtype``: attend over K and V as a host pool of that dtype gives them back (the selection
    reads the exact keys)."""
    length = k_seq.shape[0]
    state = states.get(b)
    fresh = (
        state is None
        or state.length != length - 1
        or not torch.equal(state.probe, k_seq[length - 2])
    ) if length > 1 else True
    if fresh:
        state = NosaDecodeState(cfg, k_seq.shape[1], k_seq.shape[2], device=k_seq.device)
        states[b] = state
    with torch.no_grad():  # cis of every token: the HF cache holds no eviction scores
        kv = ContiguousKV(k_seq, v_seq, evict(v_seq))
        state.append(kv)
    state.probe = k_seq[length - 1].clone()
    attend_kv = _as_host_pool_returns(k_seq, v_seq, host_dtype)
    if attend_kv is not None:
        kv = ContiguousKV(*attend_kv, kv.cis_all)
    return state.attend(q, kv, scale)


def _as_host_pool_returns(k, v, host_kv):
    """(k, v) as a host pool gives them back (nosa.kvquant.roundtrip; ``host_kv``: (dtype, the int8
    keys' factors [Hkv, D] or None)), or None without one (``host_kv_dtype`` not active)."""
    if host_kv is None:
        return None
    dtype, factor = host_kv
    return roundtrip(k, dtype, factor=factor), roundtrip(v, dtype)


@contextlib.contextmanager
def host_kv_dtype(model, dtype: torch.dtype | None, key_factors: dict[int, torch.Tensor] | None = None):
    """While active, the NOSA layers of ``model`` attend (outside training) over K and V as a host
    pool of ``dtype`` gives them back (nosa.kvquant.roundtrip: ``int8`` / ``float8_e4m3fn``; int8 keys
    divided by ``key_factors``, {layer index: [Hkv, D]} as nosa.kv_calibrate.load_key_factors reads a
    checkpoint's, when given), the selection still reading the exact keys and eviction scores: what a
    server with $NOSA_HOST_KV_DTYPE and offloading computes, the reference its replies are tested
    against."""
    modules = nosa_attention_modules(model)
    if not modules:
        raise ValueError(f"host_kv_dtype: {type(model).__name__} is not a NOSA model (nosa.convert it)")
    if key_factors is not None and dtype != torch.int8:
        raise ValueError(f"host_kv_dtype: key factors apply to int8 keys, not {dtype}")
    for _, m in modules:
        factor = None if key_factors is None else key_factors[m.layer_idx]
        m._nosa_host_kv = None if dtype is None else (dtype, factor)
        m.__dict__.pop("_nosa_states", None)  # states built without it must not be reused
    try:
        yield model
    finally:
        for _, m in modules:
            m.__dict__.pop("_nosa_host_kv", None)
            m.__dict__.pop("_nosa_states", None)


def _valid_keys(mask: torch.Tensor | None, bsz: int, kv_len: int, device) -> torch.Tensor:
    """Real (non-padding) keys [B, L]: those some query row may attend to. (Not just the last row's:
    with packed documents the last row sees only its own document.)"""
    if mask is None:
        return torch.ones(bsz, kv_len, dtype=torch.bool, device=device)
    seen = mask[:, 0, :, :kv_len]
    if seen.dtype != torch.bool:
        seen = seen == 0
    return seen.any(dim=1).expand(bsz, kv_len)


def _document_bounds(position_ids: torch.Tensor | None, b: int, rows: torch.Tensor | None) -> torch.Tensor | None:
    """cu_seqlens [docs + 1] of batch row b's real rows (``rows``, None: all) when its position_ids
    restart (packed documents), else None. A document starts wherever a position is not its
    predecessor's + 1."""
    if position_ids is None:
        return None
    pos = position_ids[min(b, position_ids.shape[0] - 1)]
    if rows is not None:
        pos = pos.index_select(0, rows)
    starts = (pos[1:] != pos[:-1] + 1).nonzero().squeeze(1) + 1
    if starts.numel() == 0:
        return None
    ends = torch.tensor([0, pos.numel()], device=pos.device)
    return torch.cat([ends[:1], starts, ends[1:]])


def _attention_modules(model):
    modules = [m for name, m in model.named_modules() if name.endswith("self_attn")]
    if not modules:
        raise ValueError(f"nosa: found no '*.self_attn' modules in {type(model).__name__}")
    return modules
