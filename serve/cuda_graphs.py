"""CUDA graphs where the nosa backend serves: decode graphs on, breakable prefill graphs off.

SGLang 0.5.23 on CUDA captures decode graphs (backend "full") and breakable prefill graphs by
default. The nosa backend implements the decode graph runner's hooks (``init_cuda_graph_state``,
``init_forward_metadata_out_graph`` / ``_in_graph``, ``get_cuda_graph_seq_len_fill_value``: its
decode step runs on fixed shapes, nosa.serve.decode_runner), so decode graphs stay as the server
arguments say. It has no capture path for prefill (``init_forward_metadata_for_breakable_cuda_graph_capture``:
a prefill chunk's selection and the blocks it reads depend on the data), and AttentionBackend's
default raises a bare NotImplementedError while the server starts. This hook runs in SGLang's
server-argument resolution (the plugin step ``handle_attention_backend_compatibility``, where SGLang
itself turns graphs off for torch_native and flex_attention) and sets the prefill graph backend to
"disabled" wherever nosa is the prefill attention backend, logging a warning that names the flag.
CPU servers are left alone: SGLang captures no graph there unless torch.compile is on (its CPU
graph runner, decode only).
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

STEP = "handle_attention_backend_compatibility"
BACKEND_NAME = "nosa"
_INSTALLED: list = []


def prefill_graphs_off_for_nosa(server_args, previous) -> None:
    """Resolution-hook wrapper (``fn(server_args, previous)``): SGLang's step, then prefill graphs
    off where nosa serves prefill."""
    previous(server_args)
    from sglang.srt.arg_groups.overrides import attention_backends_of, declare_resolution, resolved_view, resolving_view
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    cfg = resolving_view(server_args)
    if str(cfg.device or "").split(":")[0] == "cpu" or cfg.cuda_graph_config is None:
        return
    prefill, _ = attention_backends_of(resolved_view(server_args))
    config = cfg.cuda_graph_config
    if prefill == BACKEND_NAME and getattr(config, Phase.PREFILL).backend != Backend.DISABLED:
        config = with_phase(config, Phase.PREFILL, backend=Backend.DISABLED)
        declare_resolution(server_args, "nosa.serve.cuda_graphs", cuda_graph_config=config)
        logger.warning("CUDA graphs disabled for prefill: the nosa attention backend captures decode steps only "
                       "(same as passing --disable-prefill-cuda-graph)")


def install() -> None:
    """Register the hook once per process (the plugin's register() may run more than once)."""
    if _INSTALLED:
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    register_resolution_hook(STEP)(prefill_graphs_off_for_nosa)
    _INSTALLED.append(True)
