"""The nosa backend's graph hooks on CPU, on SGLang's own request and KV pools (no server, no GPU):
the fill value of padding rows, the decode metadata written in place into buffers allocated once
(the same tensors every step, as a captured graph needs), ``init_forward_metadata_in_graph``
recorded without a host synchronisation (compiled with fullgraph=True), and padding rows that
change no request's state, as SGLang's decode graph runner drives the hooks (capture on padding
rows only, then replays of padded batches)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("sglang")
import nosa  # noqa: E402
from nosa.bench import tiny_checkpoint as tiny  # noqa: E402

CFG = nosa.NosaConfig.tiny(dense_len=64)
HKV, D, HQ, LAYERS = 2, 32, 4, 2
MAX_BS = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny.make_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "nosa"), CFG, seed=0, evict_scale=1.0)


def _backend(ckpt):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    from nosa.serve.backend import NosaAttnBackend

    req = ReqToTokenPool(size=MAX_BS, max_context_len=512, device="cpu", enable_memory_saver=False)
    kv = MHATokenToKVPool(size=2048, page_size=1, dtype=torch.float32, head_num=HKV, head_dim=D, layer_num=LAYERS,
                          device="cpu", enable_memory_saver=False)
    model_config = SimpleNamespace(hf_text_config=SimpleNamespace(num_hidden_layers=LAYERS, num_key_value_heads=HKV),
                                   head_dim=D, model_path=ckpt, revision=None)
    runner = SimpleNamespace(device="cpu", req_to_token_pool=req, token_to_kv_pool=kv, model_config=model_config,
                             token_to_kv_pool_allocator=SimpleNamespace(size=2048),
                             server_args=SimpleNamespace(tp_size=1))
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_tp_rank=0, attn_tp_size=1):  # one rank, as a scheduler of TP 1 publishes
        return NosaAttnBackend(runner)


def _batch(rows, lengths, out_cache_loc):
    """A decode ForwardBatch as the graph runner hands it to the hooks (its padded buffers)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    return SimpleNamespace(batch_size=len(rows), forward_mode=ForwardMode.DECODE,
                           req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(lengths),
                           seq_lens_cpu=torch.tensor(lengths), out_cache_loc=torch.tensor(out_cache_loc),
                           num_padding=rows.count(0))


def _layer(layer_id):
    from sglang.srt.layers.radix_attention import AttentionType

    return SimpleNamespace(layer_id=layer_id, tp_q_head_num=HQ, tp_k_head_num=HKV, qk_head_dim=D, v_head_dim=D,
                           scaling=D**-0.5, is_cross_attention=False, attn_type=AttentionType.DECODER,
                           sliding_window_size=None)


def _decode(backend, fb, seed):
    g = torch.Generator().manual_seed(seed)
    n = fb.batch_size
    for layer in range(LAYERS):
        q = torch.randn(n, HQ * D, generator=g)
        k, v = torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)
        backend.forward_decode(q, k, v, _layer(layer), fb)


def _request_state(backend):
    pool = backend.states.pool
    pages = [p for p in range(pool.num_pages) if p != 0]
    return [torch.stack(pool.ck)[:, :, pages], torch.stack(pool.static)[:, pages], torch.stack(pool.selection)[:, 1:],
            torch.stack(pool.tail_cis)[:, 1:], pool.table[1:].clone()]


def test_fill_value_in_place_metadata_and_padding(ckpt):
    backend = _backend(ckpt)
    assert backend.get_cuda_graph_seq_len_fill_value() == 1 == backend.get_cpu_graph_seq_len_fill_value()
    backend.init_cuda_graph_state(MAX_BS, MAX_BS)
    # two requests with prompts in SGLang's pool (rows 1, 2), as after their prefill
    g = torch.Generator().manual_seed(0)
    req_to_token, kv = backend.req_to_token_pool.req_to_token, backend.token_to_kv_pool
    prompts = {1: 150, 2: 40}
    slots = torch.randperm(2000, generator=g)[:300] + 1
    start = 0
    for row, n in prompts.items():
        req_to_token[row, :n] = slots[start : start + n].int()
        req_to_token[row, n] = slots[start + n].int()  # the first decode token's slot
        start += n + 1
    for layer in range(LAYERS):
        kv.k_buffer[layer][:] = torch.randn(kv.k_buffer[layer].shape, generator=g)
        kv.v_buffer[layer][:] = torch.randn(kv.v_buffer[layer].shape, generator=g)

    # capture: padding rows only, the in-graph half compiled with no graph break (no host reads)
    capture = _batch([0] * MAX_BS, [1] * MAX_BS, [0] * MAX_BS)
    backend.init_forward_metadata_out_graph(capture, in_capture=True)
    in_graph = torch.compile(backend.init_forward_metadata_in_graph, fullgraph=True, dynamic=False,
                             backend="aot_eager")
    in_graph(capture)
    inputs = backend.decode.inputs
    buffers = [inputs.rows.data_ptr(), inputs.lengths.data_ptr(), inputs.real.data_ptr(), inputs.warm.data_ptr()]
    assert int(inputs.num_real) == 0 and not bool(inputs.real.any())
    before = _request_state(backend)
    _decode(backend, capture, seed=1)  # the capture's forward: padding rows only
    for x, y in zip(before, _request_state(backend)):
        assert torch.equal(x, y)

    # replays: the requests padded to the graph's batch, metadata written into the same buffers
    for step in range(3):
        rows = [1, 2, 0, 0]
        lengths = [prompts[1] + 1 + step, prompts[2] + 1 + step, 1, 1]
        loc = [int(req_to_token[r, n - 1]) if r else 0 for r, n in zip(rows, lengths)]
        for r, n in zip(rows[:2], lengths[:2]):
            req_to_token[r, n] = slots[-1 - step - r].int()
        fb = _batch(rows, lengths, loc)
        backend.init_forward_metadata_out_graph(fb)
        in_graph(fb)
        assert backend.decode.inputs is inputs and int(inputs.num_real) == 2
        assert [t.data_ptr() for t in (inputs.rows, inputs.lengths, inputs.real, inputs.warm)] == buffers
        assert inputs.rows.tolist() == rows and inputs.lengths.tolist() == lengths
        assert inputs.real.tolist() == [True, True, False, False]
        # on CPU the selection picks a context bucket on the lengths (a CUDA graph reads the longest context's)
        assert inputs.spans.static and inputs.spans.blocks is None and inputs.spans.windows is None
        _decode(backend, fb, seed=10 + step)
    for row, n in prompts.items():
        for layer in range(LAYERS):
            assert backend.states.get(row, layer).length == n + 3
    # a batch of padding rows now that the requests have states: none of them changes
    before = _request_state(backend)
    backend.init_forward_metadata_out_graph(capture)
    in_graph(capture)
    _decode(backend, capture, seed=99)
    for x, y in zip(before, _request_state(backend)):
        assert torch.equal(x, y)
