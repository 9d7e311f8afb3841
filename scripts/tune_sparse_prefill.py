"""Launch sweep of the block-sparse prefill kernels (nosa.kernels.sparse_prefill) at the prefill row
of scripts/bench_kernels.py on CUDA: 32K tokens, Llama-3-8B heads (Hq 32, Hkv 8, D 128, bf16, block
64, top-k 64), its selection (nosa.bench.kernel_speed.prefill_selection).

A config is (num_warps, num_stages, query tile), the launch the same for all three kernels
(forward, dq, dkdv); the tiles are choose_tile's candidates (the largest and its halves), its own
pick first. The default is sparse_prefill.LAUNCH at choose_tile's pick. Every config runs once
against the default: one whose output or gradients differ by more than --tol of their largest
value is marked broken and never timed, so it cannot win. Then the forward and the forward +
backward of the default, of every checked config and of dense causal SDPA (the benchmark's
baseline: K/V repeated for the group, flash kernel) are timed in interleaved rounds (CUDA events;
the median). All get their tile explicitly, so choose_tile's own cost counts for none.

"backward" is forward + backward minus forward. The best forward launch and the best backward
launch of one tile (the kernels take separate launches) make the "recommended" config, checked and
timed again beside the default and dense at the end.

JSON: every config's ms, the best per pass with its speedup over the default config
("speedup_vs_default") and over dense ("speedup_vs_dense", the benchmark's dense_over_nosa: above
1 the sparse kernel is faster). --budget-s bounds the run: the configs it leaves unchecked are
listed as skipped, rounds stop early, and "notes" says so.

    python scripts/tune_sparse_prefill.py --out results/gpu/tune_prefill.json      # H200: ~200 s
    GPU_CHECK_ONLY=tune_prefill GPU_CHECK_FLASHINFER=0 bash scripts/gpu_check.sh    # the same, as a step
    TRITON_INTERPRET=1 python scripts/tune_sparse_prefill.py --cpu-smoke --out /tmp/t.json  # tiny, on CPU
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from nosa.bench.kernel_speed import CUDA_PREFILL_CONTEXT, CUDA_SHAPE, dense_prefill_inputs, prefill_inputs
from nosa.bench.results import write_result
from nosa.kernels import sparse_prefill as sp

SHAPE = dict(context=CUDA_PREFILL_CONTEXT, **CUDA_SHAPE)  # nosa.bench.kernel_speed's CUDA prefill row
SMOKE_SHAPE = dict(context=64, hq=2, hkv=1, d=16, block=16, topk=4, dtype=torch.float32)  # interpreter
PASSES = ("forward", "forward_backward")


def build(shape: dict, device: str):
    """Inputs as the benchmark makes them: q, k, v (leaves), cis, sel, positions, dout."""
    return prefill_inputs(**shape, device=device, g=None)


def sparse_fns(inputs, shape, tile, launch):
    """(forward, forward + backward) of one config: callables returning (out, lse) and grads."""
    q, k, v, cis, sel, positions, dout = inputs
    args = (q, k, v, cis, sel, positions, shape["block"], shape["d"] ** -0.5)

    def forward():
        with torch.no_grad():
            return sp.sparse_prefill(*args, tile=tile, launch=launch)

    def forward_backward():
        out, lse = sp.sparse_prefill(*args, tile=tile, launch=launch)
        return (out.detach(), lse, *torch.autograd.grad(out, (q, k, v, cis), dout))

    return forward, forward_backward


def dense_fns(inputs, shape):
    """Dense causal SDPA forward and forward + backward, as the benchmark's baseline."""
    q, k, v, _, _, _, dout = inputs
    qd, kd, vd, dd = dense_prefill_inputs(q, k, v, dout, shape["hq"] // shape["hkv"])

    def forward():
        with torch.no_grad():
            return F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)

    def forward_backward():
        return torch.autograd.grad(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True), (qd, kd, vd), dd)

    return forward, forward_backward


def time_ms(fn, reps: int, device: str) -> list[float]:
    """Milliseconds of each of ``reps`` calls of fn (CUDA events; the wall clock on CPU)."""
    out = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
    return out


def check(fwd_bwd, want, tol: float) -> tuple[dict, bool]:
    """({tensor: max abs diff against the default's}, whether each is within tol of its largest value)."""
    got = fwd_bwd()
    names = ("out", "lse", "dq", "dk", "dv", "dcis")
    diff = {n: (g.float() - w.float()).abs().max().item() for n, g, w in zip(names, got, want)}
    ok = all(diff[n] <= tol * max(w.float().abs().max().item(), 1e-6) for n, w in zip(names, want))
    return diff, ok


def launch_of(warps: int, stages: int) -> dict:
    return {name: {"num_warps": warps, "num_stages": stages} for name in sp.LAUNCH}


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def recommend(rows: list[dict]) -> tuple[int, dict]:
    """(tile, launch) of the best forward launch and the best backward launch of one tile, the tile
    with the least forward + backward between them (the kernels take their launches separately)."""
    def best(tile, key):
        return min((c for c in rows if c["tile"] == tile), key=lambda c: c[key])

    tile = min({c["tile"] for c in rows},
               key=lambda t: best(t, "forward_ms")["forward_ms"] + best(t, "backward_ms")["backward_ms"])
    fwd, bwd = best(tile, "forward_ms"), best(tile, "backward_ms")
    return tile, {**launch_of(bwd["num_warps"], bwd["num_stages"]),
                  "forward": launch_of(fwd["num_warps"], fwd["num_stages"])["forward"]}


class Timer:
    """The sweep's timing: configs' (forward, forward + backward) callables, their samples in ms,
    and interleaved rounds that stop early when the budget would run out."""

    def __init__(self, device: str, reps: int, deadline: float, notes: list):
        self.device, self.reps, self.deadline, self.notes = device, reps, deadline, notes
        self.fns, self.samples = {}, {}

    def add(self, name: str, fns) -> None:
        self.fns[name], self.samples[name] = fns, {p: [] for p in PASSES}

    def rounds(self, names: list[str], count: int) -> None:
        """``count`` rounds over ``names``, every config's passes in turn, the order reversed every
        other round (drift and position count alike for all); the first round always runs."""
        for i in range(count):
            r0 = time.perf_counter()
            for name in names if i % 2 == 0 else names[::-1]:
                for fn, p in zip(self.fns[name], PASSES):
                    self.samples[name][p] += time_ms(fn, self.reps, self.device)
            if i + 1 < count and self.deadline - time.perf_counter() < (time.perf_counter() - r0) * 1.1:
                self.notes.append(f"budget: {i + 1} of {count} rounds timed over {len(names)} configs")
                return

    def ms(self, name: str) -> dict:
        """{pass: median ms}, and speedup_vs_default / speedup_vs_dense of the same rounds."""
        out = {f"{p}_ms": statistics.median(self.samples[name][p]) for p in PASSES}
        out["backward_ms"] = out["forward_backward_ms"] - out["forward_ms"]
        for base in ("default", "dense"):
            out[f"speedup_vs_{base}"] = {p: statistics.median(self.samples[base][p]) / out[f"{p}_ms"] for p in PASSES}
        return out


def sweep(args, device: str, shape: dict, rounds: int, reps: int) -> dict:
    """The whole sweep (the module docstring) as the JSON's dict, provenance aside."""
    t0 = time.perf_counter()
    torch.manual_seed(0)
    inputs = build(shape, device)
    group = shape["hq"] // shape["hkv"]
    chosen = sp.choose_tile(inputs[4].to(torch.int32), -(-shape["context"] // shape["block"]), group)
    tiles = sorted(args.tiles or sp.tile_candidates(group), key=lambda t: t != chosen)  # a cut budget loses the others
    grid = list(itertools.product(tiles, args.warps, args.stages))
    if args.cpu_smoke:
        grid = [(tiles[-1], 8, 2)]  # one config besides the default: the smallest tile, other warps and stages
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (TRITON_INTERPRET=1)",
              "shape": {k: str(v) for k, v in shape.items()}, "grid": {"tiles": tiles, "warps": args.warps,
                                                                       "stages": args.stages},
              "tol": args.tol, "budget_s": args.budget_s, "rounds": rounds, "reps": reps, "notes": []}
    timer = Timer(device, reps, t0 + args.budget_s, result["notes"])
    # the default launch at choose_tile's pick, given explicitly as every config's tile is: choose_tile's
    # own cost (a few small kernels) is then left out of all of them alike
    timer.add("dense", dense_fns(inputs, shape))
    timer.add("default", sparse_fns(inputs, shape, chosen, None))
    want = timer.fns["default"][1]()  # the default's output and gradients (compiles its kernels)
    timer.fns["dense"][1]()
    # what one config costs per round (each pass reps times), to leave the rounds their time
    per_config = sum(time_ms(fn, 1, device)[0] for fn in timer.fns["default"]) * reps / 1e3
    reserve = per_config * (len(grid) + 5) * rounds * 1.2 + 5

    configs = []
    for tile, warps, stages in grid:
        row = {"name": f"w{warps}-s{stages}-t{tile}", "num_warps": warps, "num_stages": stages, "tile": tile}
        configs.append(row)
        if time.perf_counter() - t0 > args.budget_s - reserve:
            row["skipped"] = "budget"
            continue
        c0 = time.perf_counter()
        fns = sparse_fns(inputs, shape, tile, launch_of(warps, stages))
        try:
            row["max_abs_diff"], row["ok"] = check(fns[1], want, args.tol)
        except Exception as e:  # e.g. out of shared memory at more stages: record it and go on
            row["error"] = repr(e)[:300]
            continue
        row["compile_check_s"] = round(time.perf_counter() - c0, 2)
        print("checked", row, flush=True)
        if row["ok"]:  # a broken config is never timed, so it cannot win
            timer.add(row["name"], fns)
    skipped = [c["name"] for c in configs if "skipped" in c]
    if skipped:
        result["notes"].append(f"budget: {len(skipped)} configs not checked or timed: {' '.join(skipped)}")

    timer.rounds(list(timer.fns), rounds)
    result["dense_ms"] = {p: statistics.median(timer.samples["dense"][p]) for p in PASSES}
    result["default"] = {"name": "default", "tile": chosen, "launch": sp.LAUNCH, **timer.ms("default")}
    for row in configs:
        if row["name"] in timer.fns:
            row.update(timer.ms(row["name"]))
    timed = [result["default"]] + [c for c in configs if "forward_ms" in c]
    result["best"] = {}
    for p in (*PASSES, "backward"):
        best = min(timed, key=lambda c: c[f"{p}_ms"])
        result["best"][p] = {"config": best["name"], "ms": best[f"{p}_ms"]}
        if p in PASSES:
            result["best"][p].update({k: best[k][p] for k in ("speedup_vs_default", "speedup_vs_dense")})
    result["configs"] = configs

    if len(timed) > 1:  # the per-kernel pick, checked and timed again beside the default and dense
        tile, launch = recommend(timed[1:])
        fns = sparse_fns(inputs, shape, tile, launch)
        diff, ok = check(fns[1], want, args.tol)
        timer.add("recommended", fns)
        timer.add("default", timer.fns["default"])  # fresh samples: the comparison is of these rounds
        timer.add("dense", timer.fns["dense"])
        timer.rounds(["dense", "default", "recommended"], rounds)
        result["recommended"] = {"tile": tile, "launch": launch, "max_abs_diff": diff, "ok": ok,
                                 **timer.ms("recommended")}
    result["elapsed_s"] = round(time.perf_counter() - t0, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/gpu/tune_prefill.json", help="where the JSON goes")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and repeats (2 x 3 instead of 3 x 5)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="with TRITON_INTERPRET=1 and no GPU: a tiny shape, the default and one other config "
                             "(tests the script, measures nothing)")
    parser.add_argument("--budget-s", type=float, default=200.0,
                        help="seconds for the whole sweep: configs left unchecked when it runs out are skipped")
    parser.add_argument("--warps", type=parse_ints, default=[4, 8], help="num_warps values (comma-separated)")
    parser.add_argument("--stages", type=parse_ints, default=[1, 2, 3, 4], help="num_stages values")
    parser.add_argument("--tiles", type=parse_ints, default=None,
                        help="query tiles (default: choose_tile's candidates, the largest and its halves)")
    parser.add_argument("--tol", type=float, default=2e-2,
                        help="largest difference from the default's output and gradients, as a fraction of "
                             "their largest value, for a config to count")
    args = parser.parse_args()
    if torch.cuda.is_available():
        device, shape = "cuda", SHAPE
    elif args.cpu_smoke and os.environ.get("TRITON_INTERPRET") == "1":
        device, shape = "cpu", SMOKE_SHAPE
    else:
        sys.exit("tune_sparse_prefill: needs a CUDA GPU (without one: TRITON_INTERPRET=1 ... --cpu-smoke)")
    rounds, reps = (1, 1) if args.cpu_smoke else (2, 3) if args.quick else (3, 5)
    result = sweep(args, device, shape, rounds, reps)
    write_result(args.out, result)
    print({k: result.get(k) for k in ("default", "best", "recommended", "notes")}, flush=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
