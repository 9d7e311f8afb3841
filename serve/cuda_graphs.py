"""CUDA graphs off for the phases the nosa backend serves (until it has a capture path).

SGLang 0.5.23 on CUDA captures decode graphs (backend "full") and breakable prefill graphs by
default. Its decode graph runner calls the attention backend's ``init_cuda_graph_state`` while the
server starts, and the breakable prefill runner ``init_forward_metadata_for_breakable_cuda_graph_capture``;
the nosa backend implements neither (AttentionBackend's defaults raise a bare NotImplementedError),
so without ``--disable-cuda-graph`` a CUDA server would die during start-up with no hint. This
hook runs in SGLang's server-argument resolution (the plugin step ``handle_attention_backend_compatibility``,
where SGLang itself turns graphs off for torch_native and flex_attention) and sets the decode and/or
prefill graph backend to "disabled" wherever nosa is that phase's attention backend, logging a
warning that names the equivalent flag. CPU servers are left alone: SGLang captures no graph there
unless torch.compile is on.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

STEP = "handle_attention_backend_compatibility"
BACKEND_NAME = "nosa"
_INSTALLED: list = []


def disable_for_nosa(server_args, previous) -> None:
    """Resolution-hook wrapper (``fn(server_args, previous)``): SGLang's step, then graphs off for
    the nosa phases."""
    previous(server_args)
    from sglang.srt.arg_groups.overrides import attention_backends_of, declare_resolution, resolved_view, resolving_view
    from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, with_phase

    cfg = resolving_view(server_args)
    if str(cfg.device or "").split(":")[0] == "cpu" or cfg.cuda_graph_config is None:
        return
    prefill, decode = attention_backends_of(resolved_view(server_args))
    config, turned = cfg.cuda_graph_config, []
    for phase, backend in ((Phase.DECODE, decode), (Phase.PREFILL, prefill)):
        if backend == BACKEND_NAME and getattr(config, phase).backend != Backend.DISABLED:
            config = with_phase(config, phase, backend=Backend.DISABLED)
            turned.append(phase)
    if turned:
        declare_resolution(server_args, "nosa.serve.cuda_graphs", cuda_graph_config=config)
        logger.warning("CUDA graphs disabled for %s: the nosa attention backend has no CUDA-graph capture path yet "
                       "(same as passing --disable-cuda-graph)", " and ".join(turned))


def install() -> None:
    """Register the hook once per process (the plugin's register() may run more than once)."""
    if _INSTALLED:
        return
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    register_resolution_hook(STEP)(disable_for_nosa)
    _INSTALLED.append(True)
