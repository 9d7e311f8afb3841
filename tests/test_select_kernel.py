"""The CPU selection kernel (nosa.kernels.select_cpu) against its spec, nosa.select.select_blocks: the
same blocks, bit for bit, on inputs built to hit every branch of the spec (ties, infinities, NaN,
A = 0 heads beside live ones, a shared or per-row eviction score, fewer blocks than the budget), and
the serving decode step, which picks it, selects what the torch code selects."""

from __future__ import annotations

import os

import pytest
import torch

from nosa import ops
from nosa.config import NosaConfig
from nosa.kernels import cpu_build, select_cpu
from nosa.select import select_blocks

pytestmark = pytest.mark.skipif(select_cpu.library() is None, reason="no C++ compiler: the kernel cannot build")


def _case(g: torch.Generator, trial: int):
    def ri(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=g))

    rows, hkv, nb = ri(1, 5), ri(1, 4), ri(0, 90)
    window, picks, sink = ri(2, 5), ri(0, 5), ri(0, 3)
    cfg = NosaConfig(block_size=16, compress_kernel=16, compress_stride=8, sink_blocks=sink, window_blocks=window,
                     query_blocks=picks, topk_blocks=sink + window + picks + ri(0, 12), dense_len=0)
    qs = torch.randn(rows, hkv, nb, generator=g)
    qs = torch.where(torch.rand(qs.shape, generator=g) < 0.3, qs.round(), qs)  # ties
    qs = torch.where(torch.rand(qs.shape, generator=g) < 0.15, float("-inf"), qs)  # windows not visible
    qs = torch.where(torch.rand(qs.shape, generator=g) < 0.05, float("nan"), qs)
    qs = torch.where(torch.rand(qs.shape, generator=g) < 0.02, float("inf"), qs)
    qs = torch.where(torch.rand(qs.shape, generator=g) < 0.05, -0.0, qs)
    shared = trial % 2 == 0  # the static keys of a prefill (one for every row) or of each row
    evict = torch.randn(1 if shared else rows, hkv, nb, 2, generator=g).round(decimals=1)  # ties
    if trial % 4 == 1:
        evict.zero_()  # A = 0: the query ranks every block
    elif trial % 4 == 3:
        evict[:, 0] = 0.0  # one head off beside live ones
    evict = torch.where(torch.rand(evict.shape, generator=g) < 0.1, float("-inf"), evict)
    evict = torch.where(torch.rand(evict.shape, generator=g) < 0.03, float("inf"), evict)
    evict = torch.where(torch.rand(evict.shape, generator=g) < 0.03, float("nan"), evict)
    positions = torch.randint(0, max(nb, 1) * cfg.block_size + 40, (rows,), generator=g)  # some past nb blocks
    return qs, evict, positions, cfg


@pytest.mark.parametrize("seed", range(4))
def test_the_kernel_selects_what_the_spec_selects(seed):
    g = torch.Generator().manual_seed(seed)
    for trial in range(150):
        qs, evict, positions, cfg = _case(g, trial)
        want = select_blocks(qs, evict, positions, cfg)
        got = select_cpu.select_blocks(qs, evict, positions, cfg)
        assert torch.equal(got, want), (trial, cfg, got, want)


def test_long_contexts_and_other_dtypes():
    """A 64K-token context's 1,025 blocks of 64 at the released budget; bf16 scores, float64 static
    keys and int32 positions go through the float32 / int64 the spec reads."""
    g = torch.Generator().manual_seed(7)
    cfg = NosaConfig()
    nb = 1025
    qs = torch.rand(4, 2, nb, generator=g).bfloat16()
    evict = torch.randn(4, 2, nb, 2, generator=g).double()
    positions = torch.tensor([65536, 40000, 70, 4096], dtype=torch.int32)
    for e in (evict, torch.zeros_like(evict)):
        want = select_blocks(qs, e, positions.long(), cfg)
        assert torch.equal(select_cpu.select_blocks(qs, e, positions, cfg), want)
        assert int((want >= 0).sum(-1).min()) == 2  # the 70-token row: 2 blocks exist


def test_ops_picks_the_kernel_on_cpu_unless_told_not_to(monkeypatch):
    calls = []
    real = select_cpu.select_blocks
    monkeypatch.setattr(select_cpu, "select_blocks", lambda *a: calls.append(1) or real(*a))
    qs, evict, positions, cfg = _case(torch.Generator().manual_seed(3), 0)
    want = select_blocks(qs, evict, positions, cfg)
    assert torch.equal(ops.select_blocks(qs, evict, positions, cfg, branch_free=True), want) and calls == [1]
    monkeypatch.setenv("NOSA_KERNELS", "reference")
    assert torch.equal(ops.select_blocks(qs, evict, positions, cfg), want) and calls == [1]


def test_the_serving_decode_step_selects_as_the_torch_code(monkeypatch):
    """StatePool.select (the serving decode step's selection) with the kernel and with
    NOSA_KERNELS=reference: the same blocks in every layer and step, live and A = 0 heads."""
    from nosa.bench.decode_harness import DecodeHarness

    cfg = NosaConfig(block_size=16, compress_kernel=16, compress_stride=8, sink_blocks=1, window_blocks=2,
                     query_blocks=2, topk_blocks=8, dense_len=0)
    runs = []
    for kernels in ("auto", "reference"):
        monkeypatch.setenv("NOSA_KERNELS", kernels)
        h = DecodeHarness(cfg, [300, 517, 40], num_layers=2, new_tokens=40)
        with torch.no_grad():
            h.heads[1].scale.zero_()  # layer 1: A = 0
        sels = []
        for step in range(40):
            h.begin([1, 2, 3])
            h.forward(*h.new_tokens(step))
            sels.append(torch.stack([h.states.pool.selection[layer][1:4] for layer in range(2)]))
        runs.append(torch.stack(sels))
    assert torch.equal(runs[0], runs[1])
    assert (runs[0] >= 0).sum() > 0


def test_bad_arguments_are_named():
    cfg = NosaConfig()
    with pytest.raises(ValueError, match="positions"):
        select_cpu.select_blocks(torch.zeros(2, 1, 5), torch.zeros(2, 1, 5, 2), torch.zeros(3, dtype=torch.long), cfg)


def test_the_build_is_named_by_the_source_and_reports_a_missing_compiler(monkeypatch, tmp_path):
    monkeypatch.setenv("NOSA_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    with pytest.raises((RuntimeError, OSError)):
        cpu_build.build(select_cpu.SOURCE)
    monkeypatch.delenv("CXX")
    path = cpu_build.build(select_cpu.SOURCE)
    assert path.parent == tmp_path and path.name.startswith("select_cpu-") and path.exists()


def test_the_benchmark_times_both_selections_and_restores_the_environment(monkeypatch):
    """scripts/bench_resolve.py --parts select, shortened: each context with the kernel and with the
    torch selection, the selection's share inside the step, NOSA_KERNELS as it was."""
    from nosa import state_pool
    from nosa.bench.resolve_speed import bench_select

    monkeypatch.setenv("NOSA_KERNELS", "auto")
    with torch.inference_mode():
        report = bench_select([4200, 4600], rounds=2, steps=2, smollm2=False)  # past dense_len 4096: selected
    assert [(r["context"], r["variant"]) for r in report["rows"]] == [
        (4200, "kernel"), (4200, "torch"), (4600, "kernel"), (4600, "torch")]
    assert all(0 < r["select_ms_per_step"] < r["cpu_ms_per_step"] for r in report["rows"])
    assert set(report["longest_over_shortest"]) == {"kernel", "torch"}
    assert len(report["longest_over_shortest_by_round"]["kernel"]) == 2
    assert state_pool.StatePool.select.__name__ == "select" and os.environ["NOSA_KERNELS"] == "auto"
