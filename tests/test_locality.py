"""The locality theorem of nosa.select, as a property test over random configs and random data."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nosa import EvictionHead, NosaConfig, NosaDecodeState


@st.composite
def configs(draw):
    stride = draw(st.sampled_from([1, 2, 4]))
    block = stride * draw(st.integers(1, 4))
    kernel = stride * draw(st.integers(1, 3))
    min_window = 1 + -(-(kernel - stride) // block)
    window = draw(st.integers(min_window, min_window + 2))
    sink = draw(st.integers(0, 2))
    query = draw(st.integers(0, 3))
    topk = sink + window + query + draw(st.integers(0, 4))
    return NosaConfig(block_size=block, compress_kernel=kernel, compress_stride=stride, sink_blocks=sink,
                      window_blocks=window, topk_blocks=max(topk, 1), query_blocks=query, dense_len=0)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=configs(), seed=st.integers(0, 2**16), steps=st.integers(200, 260), repeat=st.booleans())
def test_blocks_entering_per_step_never_exceed_the_bound(cfg, seed, steps, repeat):
    torch.manual_seed(seed)
    steps = max(steps, (cfg.topk_blocks + 4) * cfg.block_size)  # the budget must bind for a while
    hq, hkv, d = 4, 2, 4
    q, k, v = torch.randn(steps, hq, d), torch.randn(steps, hkv, d), torch.randn(steps, hkv, d)
    if repeat:  # repeated text: V repeats with a period, so distant blocks tie exactly
        period = cfg.block_size * 3
        v = v[:period].repeat(steps // period + 1, 1, 1)[:steps]
    head = EvictionHead(hkv, d)
    with torch.no_grad():
        head.scale.uniform_(0.2, 2.0)  # a trained (non-zero) eviction head
        cis = head(v)
    state = NosaDecodeState(cfg, hkv, d)
    budget_binding = 0
    for t in range(steps):
        state.append_tokens(k[: t + 1], cis[: t + 1])
        state.select(q[t], d**-0.5)
        if state.entering is None:
            continue
        new_block = t % cfg.block_size == 0
        bound = cfg.query_blocks + (1 if new_block else 0)
        assert int(state.entering.max()) <= bound, (t, state.entering.tolist(), bound)
        budget_binding += int(cfg.num_blocks(t + 1) > cfg.topk_blocks)
    assert budget_binding > 0  # the budget was below the context for part of the run
