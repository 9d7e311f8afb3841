"""Block-sparse prefill (nosa.kernels.sparse_prefill): the reference against nosa_prefill (the spec),
its gradients against finite differences (fp64), and the Triton forward and backward against an
fp64 reference. Without CUDA the kernels run under TRITON_INTERPRET=1 (conftest.py)."""

import json
import os
import subprocess
import sys

import pytest
import torch

from nosa import NosaConfig, nosa_prefill
from nosa.kernels.sparse_prefill import LAUNCH, sparse_prefill, sparse_prefill_reference, tile_unions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}  # ||x - ref|| / ||ref||, fp64 reference


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def random_selection(positions, hkv, block, topk, g):
    """Per row and KV head: the current block plus random earlier ones, -1 padded (any order)."""
    sel = torch.full((len(positions), hkv, topk), -1, dtype=torch.long)
    for i, p in enumerate(positions.tolist()):
        cur = p // block
        for h in range(hkv):
            others = torch.randperm(cur, generator=g)[: topk - 1] if cur else torch.zeros(0, dtype=torch.long)
            chosen = torch.cat([torch.tensor([cur]), others])
            sel[i, h, torch.randperm(topk, generator=g)[: len(chosen)]] = chosen
    return sel


def case(length, n, hq, hkv, d, block, topk, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, hq, d, generator=g)
    k, v = torch.randn(length, hkv, d, generator=g), torch.randn(length, hkv, d, generator=g)
    cis = torch.randn(length, hkv, generator=g) * 0.5
    positions = torch.arange(length - n, length)
    sel = random_selection(positions, hkv, block, topk, g)
    return q, k, v, cis, sel, positions


@pytest.mark.parametrize("cfg, length, n", [
    (NosaConfig.tiny(), 150, 150),
    (NosaConfig.tiny(dense_len=40, topk_blocks=6, query_blocks=1), 200, 90),
])
def test_reference_is_nosa_prefill(cfg, length, n):
    """nosa_prefill's rows past dense_len are exactly the reference over the selection it returns."""
    torch.manual_seed(0)
    q, k, v = torch.randn(n, 4, 8), torch.randn(length, 2, 8), torch.randn(length, 2, 8)
    cis = torch.randn(length, 2)
    spec, sel = nosa_prefill(q, k, v, cis, cfg, 8**-0.5)
    positions = torch.arange(length - n, length)
    sparse = positions >= cfg.dense_len
    out, lse = sparse_prefill_reference(q[sparse], k, v, cis, sel[sparse], positions[sparse], cfg.block_size, 8**-0.5)
    torch.testing.assert_close(out, spec[sparse], atol=2e-6, rtol=1e-5)
    assert torch.isfinite(lse).all()


def test_reference_gradients_fp64():
    q, k, v, cis, sel, positions = case(40, 12, 2, 1, 4, 8, 3, seed=1)
    inputs = [t.double().requires_grad_() for t in (q, k, v, cis)]

    def fn(q, k, v, cis):
        out, lse = sparse_prefill_reference(q, k, v, cis, sel, positions, 8, 0.5)
        return out, lse

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6)


CASES = [  # length, n, hq, hkv, d, block, topk, tile
    (100, 24, 4, 2, 16, 16, 4, 8),
    (70, 12, 6, 3, 8, 8, 5, 4),
    (64, 10, 2, 1, 32, 16, 3, None),
]


@pytest.mark.parametrize("length, n, hq, hkv, d, block, topk, tile", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_prefill_kernel_matches_reference(length, n, hq, hkv, d, block, topk, tile, dtype):
    q, k, v, cis, sel, positions = case(length, n, hq, hkv, d, block, topk, seed=n)
    scale = d**-0.5
    g = torch.Generator().manual_seed(7)
    dout, dlse = torch.randn(n, hq, d, generator=g), torch.randn(n, hq, generator=g)
    ref_inputs = [t.double().requires_grad_() for t in (q, k, v, cis)]
    ref, ref_lse = sparse_prefill_reference(*ref_inputs, sel, positions, block, scale)
    ((ref * dout.double()).sum() + (ref_lse * dlse.double()).sum()).backward()
    inputs = [t.to(DEVICE, dtype if i < 3 else torch.float32).requires_grad_() for i, t in enumerate((q, k, v, cis))]
    out, lse = sparse_prefill(*inputs, sel.to(DEVICE), positions.to(DEVICE), block, scale, tile=tile)
    ((out.float() * dout.to(DEVICE)).sum() + (lse * dlse.to(DEVICE)).sum()).backward()
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert rel(out.cpu(), ref) < TOL[dtype]
    assert rel(lse.cpu(), ref_lse) < TOL[dtype] / 10
    for name, got, want in zip("q k v cis".split(), inputs, ref_inputs):
        assert got.grad.dtype == got.dtype
        assert rel(got.grad.cpu(), want.grad) < 2 * TOL[dtype], name
    # one block fewer for one row must show at this tolerance
    dropped = sel.clone()
    dropped[n - 1, 0, (sel[n - 1, 0] >= 0).nonzero()[0]] = -1
    assert rel(sparse_prefill_reference(q.double(), k.double(), v.double(), cis.double(), dropped, positions,
                                        block, scale)[0], ref) > 5 * TOL[torch.float32]


def test_rows_without_keys_and_unions():
    q, k, v, cis, sel, positions = case(48, 8, 2, 1, 16, 16, 3, seed=2)
    sel[3] = -1  # nothing selected: out 0, lse -inf, zero (finite) gradients
    inputs = [t.to(DEVICE).requires_grad_() for t in (q, k, v, cis)]
    out, lse = sparse_prefill(*inputs, sel.to(DEVICE), positions.to(DEVICE), 16, 0.25, tile=4)
    assert torch.all(out[3] == 0) and torch.all(lse[3] == float("-inf"))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in inputs) and torch.all(inputs[0].grad[3] == 0)
    union, count = tile_unions(sel, 3, tile=4)
    assert union.shape[:2] == (2, 1) and count.tolist() == [[len(set(sel[:4].flatten().tolist()) - {-1})],
                                                           [len(set(sel[4:].flatten().tolist()) - {-1})]]


def test_sparse_prefill_rejects_bad_input():
    q, k, v, cis, sel, positions = case(48, 8, 2, 1, 16, 16, 3)
    with pytest.raises(ValueError, match="blocks of 16"):
        sparse_prefill(q, k, v, cis, sel + 10, positions, 16, 0.25)
    with pytest.raises(ValueError, match="sel"):
        sparse_prefill(q, k, v, cis, sel[:4], positions, 16, 0.25)
    with pytest.raises(ValueError, match="share one"):
        sparse_prefill(q, k.bfloat16(), v, cis, sel, positions, 16, 0.25)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        sparse_prefill_reference(q[:, :1].expand(8, 3, 16), torch.zeros(48, 2, 16), torch.zeros(48, 2, 16),
                                 torch.zeros(48, 2), sel.expand(8, 2, 3), positions, 16, 0.25)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_launch_options_change_no_result(dtype):
    """A non-default launch (8 warps and 2 stages for every kernel, a smaller tile) computes what the
    default does (scripts/tune_sparse_prefill.py sweeps them; the interpreter ignores warps and stages,
    a GPU compiles other code for them)."""
    q, k, v, cis, sel, positions = case(100, 24, 4, 2, 16, 16, 4, seed=3)
    g = torch.Generator().manual_seed(5)
    dout, dlse = torch.randn(24, 4, 16, generator=g).to(DEVICE), torch.randn(24, 4, generator=g).to(DEVICE)
    sel, positions = sel.to(DEVICE), positions.to(DEVICE)
    results = []
    # tile 4: 8 matrix rows at G = 2, below every tile choose_tile weighs (32, 16, 8)
    for tile, launch in ((None, None), (4, {name: {"num_warps": 8, "num_stages": 2} for name in LAUNCH})):
        inputs = [t.to(DEVICE, dt).requires_grad_() for t, dt in zip((q, k, v, cis), (dtype,) * 3 + (torch.float32,))]
        out, lse = sparse_prefill(*inputs, sel, positions, 16, 0.25, tile=tile, launch=launch)
        ((out.float() * dout).sum() + (lse * dlse).sum()).backward()
        results.append([out, lse] + [t.grad for t in inputs])
    for name, got, want in zip("out lse dq dk dv dcis".split(), *results):
        assert rel(got.cpu(), want.cpu()) < TOL[dtype], name
    with pytest.raises(ValueError, match="unknown kernels"):
        sparse_prefill(*inputs, sel, positions, 16, 0.25, launch={"fwd": {"num_warps": 8}})


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run; on a GPU the sweep runs in gpu_check.sh")
def test_tune_script_cpu_smoke(tmp_path):
    """scripts/tune_sparse_prefill.py --cpu-smoke under the interpreter writes the sweep's JSON; without
    it (and without CUDA) the script says in one line that it needs a GPU."""
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    script = os.path.join(ROOT, "scripts", "tune_sparse_prefill.py")
    out = tmp_path / "tune.json"
    run = subprocess.run([sys.executable, script, "--cpu-smoke", "--out", str(out)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    for key in ("provenance", "shape", "grid", "dense_ms", "default", "configs", "best", "recommended", "notes"):
        assert key in result, key
    (config,) = result["configs"]
    assert config["ok"] and config["num_warps"] == 8 and config["num_stages"] == 2
    assert set(config["max_abs_diff"]) == {"out", "lse", "dq", "dk", "dv", "dcis"}
    for p in ("forward", "forward_backward"):
        assert config[f"{p}_ms"] > 0 and result["dense_ms"][p] > 0
        assert {"config", "ms", "speedup_vs_default", "speedup_vs_dense"} <= set(result["best"][p])
    assert result["default"]["launch"] == LAUNCH and set(result["recommended"]["launch"]) == set(LAUNCH)
    env.pop("TRITON_INTERPRET")
    run = subprocess.run([sys.executable, script, "--quick"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and run.stderr.strip().splitlines()[-1] == (
        "tune_sparse_prefill: needs a CUDA GPU (without one: TRITON_INTERPRET=1 ... --cpu-smoke)")
