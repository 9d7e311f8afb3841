"""The serving decode step on fixed shapes (nosa.serve.decode_runner), through the harness that builds
it over SGLang-like pools (nosa.bench.decode_harness), offloading off and on:

- equal to the spec (NosaDecodeState + decode_attend on each request's whole context) step after
  step, the first step catching up on the prompt, contexts crossing window and block boundaries;
- the spans of a captured step (the longest context's) give the same selections and outputs;
- under torch.compile(fullgraph=True, dynamic=False), SGLang's CPU graph runner's mode with no
  graph break allowed (a host synchronisation, a data-dependent shape would break it): the same
  selections and outputs as eager, for steps with changing lengths and a padding row, compiled
  once (no recompilation);
- padding rows write only the spare state: the requests' states are what they are without them.
"""

from __future__ import annotations

import pytest
import torch

from nosa import NosaConfig, NosaDecodeState
from nosa.bench.decode_harness import DecodeHarness
from nosa.decode import decode_attend
from nosa.kv import ContiguousKV

CFG = NosaConfig(block_size=16, compress_kernel=8, compress_stride=4, sink_blocks=1, window_blocks=3, topk_blocks=8,
                 query_blocks=3, dense_len=64)  # requests at 40 tokens attend densely, past 64 sparsely
PROMPTS = [40, 150, 203]
STEPS = 30


def _context(h: DecodeHarness, i: int, layer: int):
    """Request i's tokens (k, v, cis [n, Hkv, ...]) as the harness's KV pool holds them."""
    slots = h.req_to_token[i + 1, : h.lengths[i]].long()
    if h.offload:
        rows = h.pool.token_rows(slots)
        k, v, c = (t.reshape(-1, *t.shape[2:]) if t.dim() == 3 else t.reshape(-1) for t in h.pool.items(layer))
        return k[rows], v[rows], c[rows]
    return h.pool.k_buffer[layer][slots], h.pool.v_buffer[layer][slots], h.cis[layer][slots]


@torch.no_grad()
def _spec(h: DecodeHarness, states, q):
    """decode_attend of every request and layer on its whole context: [R, L, Hq, D]."""
    outs = []
    for i in range(len(h.lengths)):
        per_layer = []
        for layer in range(h.num_layers):
            kv = ContiguousKV(*_context(h, i, layer))
            states[i][layer].append(kv)
            per_layer.append(decode_attend([states[i][layer]], q[i : i + 1, layer], kv, h.d**-0.5)[0])
        outs.append(torch.stack(per_layer))
    return torch.stack(outs)


@pytest.mark.parametrize("prompts", [PROMPTS, [20, 45, 50]], ids=["mixed", "dense-then-sparse"])
@pytest.mark.parametrize("offload", [False, True])
def test_fixed_shape_step_equals_the_spec(offload, prompts):
    """Mixed batches, and batches whose requests are all within dense_len (a step that is not
    captured then attends each context densely, like torch_native) until they pass it."""
    h = DecodeHarness(CFG, prompts, offload=offload, seed=1)
    static = DecodeHarness(CFG, prompts, offload=offload, seed=1)
    static.init_graph_state()
    states = [[NosaDecodeState(CFG, h.hkv, h.d) for _ in range(h.num_layers)] for _ in prompts]
    rows = [1, 2, 3]
    dense_steps = 0
    for step in range(STEPS):
        q, k, v = h.new_tokens(step)
        h.begin(rows)
        static.begin(rows)
        dense = h.decode.inputs.spans.dense is not None  # its selection is skipped: nothing reads it
        dense_steps += dense
        got, got_static = h.forward(q, k, v), static.forward(q, k, v)
        want = _spec(h, states, q)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(got_static, want, rtol=1e-5, atol=1e-6)
        for layer in range(h.num_layers):
            sel = torch.stack([s[layer].selection for s in states])
            assert dense or torch.equal(h.states.pool.selection[layer][1:], sel), (step, layer)
            assert torch.equal(static.states.pool.selection[layer][1:], sel), (step, layer)
    assert (dense_steps > 0) == (prompts != PROMPTS and not offload)
    if offload:  # the counters add up, read on the host after the steps
        stats = h.engine.cache.stats
        assert stats["hits"][0] + stats["misses"][0] == stats["selected"][0] > 0


@pytest.mark.parametrize("offload", [False, True])
def test_compiled_step_equals_eager_without_recompiling(offload, monkeypatch):
    """The step under torch.compile(fullgraph=True, dynamic=False) with inductor, as SGLang's CPU
    graph runner compiles it (captured on a batch of padding rows only, as the runner does), then
    run on real batches whose lengths change every step: same outputs and selections as eager,
    one compilation, whichever context bucket the selection picks (StatePool.span_limits: here 134
    and 268 tokens, the 40-token request alone in the first; one with offloading). The compiled
    step writes the states in place: no generated loop runs over all the pages of a layer
    (functionalization turns a write through a view of a stacked [layers, ...]
    tensor into a copy of all of it every step, a cost that grows with the server's capacity), nor,
    with offloading, over a layer's host pool or device block cache (a write through a view of a
    buffer that the recall's operator mutated was compiled into a copy of the whole buffer)."""
    import torch._dynamo
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    if offload:  # the buckets do not depend on where the KV is: one (a shorter compile) with offloading
        monkeypatch.setenv("NOSA_GRAPH_SPAN_BUCKETS", "1")
    eager = DecodeHarness(CFG, PROMPTS, offload=offload, seed=2)
    graph = DecodeHarness(CFG, PROMPTS, offload=offload, seed=2)
    for h in (eager, graph):
        h.init_graph_state()
    compiled = torch.compile(graph.forward, fullgraph=True, dynamic=False)
    graph.begin([0, 0, 0])  # the capture batch: padding rows only
    _, code = run_and_get_code(compiled, *graph.new_tokens(999))
    pool = graph.states.pool
    sized = {"ck": pool.ck[0], "static": pool.static[0]}  # the pages: sized by the capacity
    if offload:  # the host pool and the device block cache, which the new tokens are written into
        cache = graph.engine.cache
        sized.update({f"host {n}": b[0] for n, b in (("k", graph.pool.k_buffer), ("v", graph.pool.v_buffer),
                                                     ("cis", graph.pool.cis_buffer))})
        sized.update({"cache k": cache.k[0], "cache v": cache.v[0], "cache cis": cache.cis[0]})
    for name, t in sized.items():
        assert f"<static_cast<int64_t>({t.numel()}L)" not in "".join(code), f"the compiled step copies {name} whole"
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(12):
            # padding rows in some steps; [1, 0, 0]: the 40-token request alone, a shorter context bucket
            rows = [[2, 3, 0], [1, 2, 3], [1, 0, 0], [1, 2, 3]][step % 4]
            q, k, v = eager.new_tokens(step)
            eager.begin(rows)
            graph.begin(rows)
            want, got = eager.forward(q, k, v), compiled(q, k, v)
            real = [i for i, r in enumerate(rows) if r]
            torch.testing.assert_close(got[real], want[real], rtol=1e-4, atol=1e-5)
            for a, b in zip(graph.states.pool.selection, eager.states.pool.selection):
                assert torch.equal(a[1:], b[1:]), step


def _pool_state(h: DecodeHarness):
    pool = h.states.pool
    return [torch.stack(pool.ck)[:, :, 1:]] + [torch.stack(ts)[:, 1:] for ts in (pool.static, pool.selection,
                                                                                pool.tail_cis)]


@pytest.mark.parametrize("offload", [False, True])
def test_padding_rows_change_no_request_state(offload):
    """The capture batch (padding rows only) leaves every request's state, page and resident block
    as it was; a padded batch gives the requests what the unpadded one gives them."""
    a = DecodeHarness(CFG, PROMPTS, offload=offload, seed=3)
    b = DecodeHarness(CFG, PROMPTS, offload=offload, seed=3)
    for h in (a, b):
        h.init_graph_state()
        h.begin([1, 2, 3])
        h.forward(*h.new_tokens(0))
    before = _pool_state(b)
    b.begin([0, 0, 0])
    b.forward(*b.new_tokens(99))
    for x, y in zip(before, _pool_state(b)):
        assert torch.equal(x, y)
    if offload:
        cache_a, cache_b = a.engine.cache, b.engine.cache
        for layer in range(a.num_layers):
            assert torch.equal(cache_a.blocks[layer][:-1], cache_b.blocks[layer][:-1])
    q, k, v = a.new_tokens(1)
    a.begin([2, 3])
    b.begin([2, 3, 0])
    pad = lambda x: torch.cat([x[1:], x[:1]])  # noqa: E731  the same requests, a padding row last
    out_a = a.forward(q[1:], k[1:], v[1:])
    out_b = b.forward(pad(q), pad(k), pad(v))
    assert torch.equal(out_a, out_b[:2])
