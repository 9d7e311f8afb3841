"""CUDA graphs where the nosa backend serves: decode graphs on, breakable prefill graphs off.

SGLang 0.5.23 on CUDA captures decode graphs and breakable prefill graphs by default. The backend
implements the decode graph runner's hooks (its decode step runs on fixed shapes,
nosa.serve.decode_runner), so decode graphs stay as the server arguments say; it has no capture
path for prefill (a prefill chunk's selection and the blocks it reads depend on the data), where
AttentionBackend's default raises a bare NotImplementedError at start-up. ``install`` registers a
hook on SGLang's server-argument resolution step ``handle_attention_backend_compatibility`` that
sets the prefill graph backend to "disabled" wherever nosa is the prefill attention backend and
logs a warning naming the flag. CPU servers are left alone (SGLang captures there only with
torch.compile: its CPU graph runner, decode only).
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
    from sglang.srt.arg_groups.overrides import (  # optional: sglang (the plugin module is imported without it)
        attention_backends_of,
        declare_resolution,
        resolved_view,
        resolving_view,
    )
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase  # optional: sglang

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
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook  # optional: sglang

    register_resolution_hook(STEP)(prefill_graphs_off_for_nosa)
    _INSTALLED.append(True)
