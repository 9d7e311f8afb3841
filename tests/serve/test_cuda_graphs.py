"""CUDA graphs and the nosa backend (nosa.serve.cuda_graphs): SGLang's real server-argument
resolution, run in-process for device="cuda" (it needs no GPU): decode graphs stay on where nosa
serves decode (its decode step has the graph hooks), prefill graphs are turned off where nosa serves
prefill (no capture path) and it is logged; without the hook SGLang would keep prefill graphs on for
nosa (and fail calling the backend's missing breakable-capture hook); CPU servers and other
backends are left alone."""

from __future__ import annotations

import logging

import pytest

pytest.importorskip("sglang")
from nosa.bench import tiny_checkpoint as tiny  # noqa: E402
from nosa.serve import cuda_graphs, plugin  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny.make_checkpoint(str(tmp_path_factory.mktemp("ckpt")))


def resolved_graphs(checkpoint, **kwargs):
    """(decode, prefill) graph backends after SGLang resolves these server arguments."""
    from sglang.srt.arg_groups.overrides import resolved_view
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(model_path=checkpoint, **kwargs)
    args.resolve_once()
    config = resolved_view(args).cuda_graph_config
    return config.decode.backend, config.prefill.backend


def test_nosa_on_cuda_keeps_decode_graphs_and_loses_prefill_graphs(checkpoint, caplog):
    plugin.register()
    with caplog.at_level(logging.WARNING, logger=cuda_graphs.__name__):
        graphs = resolved_graphs(checkpoint, device="cuda", attention_backend="nosa",
                                 cuda_graph_backend_prefill="breakable")
    assert graphs == ("full", "disabled")
    assert "--disable-prefill-cuda-graph" in caplog.text and "prefill" in caplog.text
    # graphs off by the user stay off
    assert resolved_graphs(checkpoint, device="cuda", attention_backend="nosa", disable_cuda_graph=True)[0] == \
        "disabled"


def test_only_the_phases_nosa_serves(checkpoint):
    plugin.register()
    decode, prefill = resolved_graphs(checkpoint, device="cuda", prefill_attention_backend="triton",
                                      decode_attention_backend="nosa", cuda_graph_backend_prefill="breakable")
    assert (decode, prefill) == ("full", "breakable")
    decode, prefill = resolved_graphs(checkpoint, device="cuda", prefill_attention_backend="nosa",
                                      decode_attention_backend="triton", cuda_graph_backend_prefill="breakable")
    assert (decode, prefill) == ("full", "disabled")


def test_without_the_hook_sglang_would_capture_prefill(checkpoint, monkeypatch):
    """The control: SGLang's own resolution keeps breakable prefill graphs for nosa on CUDA (what the
    hook exists for), and a CPU server is resolved the same with and without the hook."""
    from sglang.srt.arg_groups import resolution_hooks

    plugin.register()
    with_hook = resolved_graphs(checkpoint, device="cpu", attention_backend="nosa")
    hooks = {k: [f for f in v if f is not cuda_graphs.prefill_graphs_off_for_nosa]
             for k, v in resolution_hooks._HOOKS.items()}
    monkeypatch.setattr(resolution_hooks, "_HOOKS", hooks)
    assert resolved_graphs(checkpoint, device="cuda", attention_backend="nosa",
                           cuda_graph_backend_prefill="breakable")[1] == "breakable"
    assert resolved_graphs(checkpoint, device="cpu", attention_backend="nosa") == with_hook
