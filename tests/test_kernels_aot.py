"""Every Triton kernel compiled ahead of time for sm_90 (H100/H200) and sm_80 (A100), no GPU needed.

The interpreter never lowers a kernel, so compiler-only errors (tl.dot shape/dtype rules, layouts,
shared-memory or register blow-ups, constexpr mistakes) would otherwise first show on a GPU. The
launch arguments come from each kernel module's own *_plan function, so the signature compiled
here is the one the launcher passes. Shapes: the project's (Llama-3-8B-like heads: bf16, D=128,
B=64, G=4, K=64) and the tiny test shapes (there also fp32, which the tests run on a GPU).

The compiles run in one subprocess without TRITON_INTERPRET: under the interpreter (which
conftest.py turns on for CPU runs) triton's own library functions are interpreter objects and
cannot be compiled. ``PYTHONPATH=. python tests/test_kernels_aot.py [90] [80]`` runs them directly and
prints JSON.
"""

import json
import os
import subprocess
import sys
import time
import traceback

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = [90, 80]
TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64",
         torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8"}
# (name, hq, hkv, d, block, topk): the project's shape and the tiny test shape
SHARED_LIMIT = {90: 232448, 80: 166912}  # bytes of shared memory one block may opt into (H100, A100)
SHAPES = [("llama3_8b", 32, 8, 128, 64, 64), ("tiny", 4, 2, 16, 16, 8)]


def compile_kernel(kernel, args, consts, arch, num_warps, fp32=False, num_stages=None):
    """triton.compile for ("cuda", arch) with the signature of the given launch arguments (and the
    launch's num_stages where it sets one)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    runtime = [name for name in kernel.arg_names if name not in consts]
    assert len(runtime) == len(args), (runtime, len(args))
    given = dict(zip(runtime, args))
    signature = {}
    for name in kernel.arg_names:
        if name in consts:
            signature[name] = "constexpr"
        elif isinstance(given[name], torch.Tensor):
            signature[name] = "*" + TYPES[given[name].dtype]
        elif isinstance(given[name], float):
            signature[name] = "fp32"
        else:
            signature[name] = "i64" if abs(int(given[name])) >= 2**31 else "i32"
    consts = dict(consts, IEEE=fp32) if "IEEE" in consts else consts  # what a GPU runs for this dtype
    src = ASTSource(fn=kernel, signature=signature, constexprs=consts)
    options = {"num_warps": num_warps} if num_stages is None else {"num_warps": num_warps, "num_stages": num_stages}
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    assert compiled.asm.get("cubin"), "no cubin produced"
    return compiled


def t(*shape, dtype=torch.bfloat16):
    return torch.zeros(shape, dtype=dtype)


from nosa.kernels import recall, slot_decode, sparse_decode, sparse_prefill  # noqa: E402


def recall_case(arch, shape):
    _, _, _, d, block, _ = shape
    dst = (t(8, block, d), t(8, block, d), t(8, block, dtype=torch.float32))
    src = (t(32, block, d), t(32, block, d), t(32, block, dtype=torch.float32))
    idx = torch.zeros(16, dtype=torch.int64)
    _, args, consts = recall.copy_items_plan(dst, src, idx, idx)
    compile_kernel(recall.kernels()["copy"], args, consts, arch, num_warps=4)


def slot_decode_case(arch, shape, dtype):
    _, hq, hkv, d, block, topk = shape
    q = t(2, hq, d, dtype=dtype)
    k, v = t(64, block, d, dtype=dtype), t(64, block, d, dtype=dtype)
    cis = t(64, block, dtype=torch.float32)
    slots = torch.zeros(2, hkv, topk + 1, dtype=torch.int64)
    fill = torch.zeros(2, hkv, topk + 1, dtype=torch.int32)
    launches, _, _ = slot_decode.slot_decode_plan(q, k, v, cis, slots, fill, 0.1, num_splits=4)
    assert [name for name, *_ in launches] == ["split", "merge"]
    for name, _, args, consts in launches:
        compiled = compile_kernel(slot_decode.kernels()[name], args, consts, arch, 4, dtype == torch.float32)
        assert compiled.metadata.shared <= SHARED_LIMIT[arch], f"{name}: {compiled.metadata.shared} B shared"


def paged_sparse_decode_case(arch, shape):
    _, hq, hkv, d, block, topk = shape
    q = t(2, hq, d)
    k, v, cis = t(256, hkv, d), t(256, hkv, d), t(256, hkv, dtype=torch.float32)
    table = torch.zeros(2, 128, dtype=torch.int32)
    sel = torch.zeros(2, hkv, topk, dtype=torch.int32)
    lens = torch.zeros(2, dtype=torch.int32)
    _, args, consts = sparse_decode.sparse_decode_plan(q, k, v, cis, table, sel, lens, block, 0.1)
    compile_kernel(sparse_decode.kernels()["decode"], args, consts, arch, num_warps=4)


def sparse_prefill_case(arch, shape, tile=None):
    """tile: query rows per program (default: the largest; choose_tile may pick down to 16 // G)."""
    _, hq, hkv, d, block, topk = shape
    n, length = 64, 4 * block
    q, k, v = t(n, hq, d), t(length, hkv, d), t(length, hkv, d)
    cis = t(length, hkv, dtype=torch.float32)
    sel = torch.zeros(n, hkv, topk, dtype=torch.int32)
    pos = torch.zeros(n, dtype=torch.int32)
    tile = tile or sparse_prefill.default_tile(hq // hkv)
    tiles = -(-n // tile)
    union = torch.zeros(tiles, hkv, topk, dtype=torch.int32)
    count = torch.zeros(tiles, hkv, dtype=torch.int32)
    grid, args, consts, out, lse = sparse_prefill.forward_plan(q, k, v, cis, sel, pos, union, count, block, 0.1, tile)
    fwd = compile_kernel(sparse_prefill.kernels()["forward"], args, consts, arch,
                         **sparse_prefill.launch_options("forward"))
    delta = torch.zeros(n, hq)
    union[:, :, 1] = 1
    count.fill_(2)
    launches, _ = sparse_prefill.backward_plan(q, k, v, cis, sel, pos, union, count, out, lse, delta, block, 0.1, tile)
    assert [name for name, *_ in launches] == ["dq", "dkdv"]
    for name, _, args, consts, options in launches:
        bwd = compile_kernel(sparse_prefill.kernels()[name], args, consts, arch, **options)
    assert fwd.metadata.shared <= SHARED_LIMIT[arch] and bwd.metadata.shared <= SHARED_LIMIT[arch]


def recall_dequant_case(arch, shape, fmt):
    """The recall of a quantized host pool (K, V quantized with their scales, cis as it is)."""
    from nosa.kvquant import QuantizedItems

    _, _, _, d, block, _ = shape
    dst = (t(8, block, d), t(8, block, d), t(8, block, dtype=torch.float32))
    src = (QuantizedItems(torch.zeros(32, block, d, dtype=fmt), t(32, block, dtype=torch.float32), torch.bfloat16),
           QuantizedItems(torch.zeros(32, block, d, dtype=fmt), t(32, block, dtype=torch.float32), torch.bfloat16),
           t(32, block, dtype=torch.float32))
    idx = torch.zeros(16, dtype=torch.int64)
    _, args, consts = recall.copy_items_dequant_plan(dst, src, idx, idx)
    compile_kernel(recall.dequant_kernels()["copy_dequant"], args, consts, arch, num_warps=4)


def cases():
    """(case id, function, args) of every compile."""
    out = []
    for arch in ARCHS:
        for shape in SHAPES:
            out.append((f"recall-{shape[0]}-sm{arch}", recall_case, (arch, shape)))
            for fmt in (torch.int8, torch.float8_e4m3fn):
                name = f"recall_dequant-{str(fmt)[6:]}-{shape[0]}-sm{arch}"
                out.append((name, recall_dequant_case, (arch, shape, fmt)))
            for dtype in (torch.bfloat16, torch.float32) if shape[0] == "tiny" else (torch.bfloat16,):
                name = f"slot_decode-{shape[0]}-{str(dtype)[6:]}-sm{arch}"
                out.append((name, slot_decode_case, (arch, shape, dtype)))
            out.append((f"paged_sparse_decode-{shape[0]}-sm{arch}", paged_sparse_decode_case, (arch, shape)))
            out.append((f"sparse_prefill-{shape[0]}-sm{arch}", sparse_prefill_case, (arch, shape)))
            if shape[0] != "tiny":  # the smallest tile choose_tile may pick: 16 matrix rows
                small = max(1, 16 // (shape[1] // shape[2]))
                out.append((f"sparse_prefill-{shape[0]}-tile{small}-sm{arch}", sparse_prefill_case,
                            (arch, shape, small)))
    return out


CASE_IDS = [c[0] for c in cases()]


@pytest.fixture(scope="module")
def compiled():
    """Every compile, in one subprocess per architecture (run side by side) without the
    interpreter; {case id: "ok" or the error}."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)  # this checkout's nosa
    procs = [subprocess.Popen([sys.executable, __file__, str(arch)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for arch in ARCHS]
    results = {}
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=600)
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        assert lines, f"AOT subprocess printed no result (rc {proc.returncode}):\n{stderr[-3000:]}"
        results.update(json.loads(lines[-1]))
    return results


@pytest.mark.parametrize("case", CASE_IDS)
def test_kernel_compiles_ahead_of_time(compiled, case):
    assert compiled.get(case) == "ok", compiled.get(case, "case missing")


def main(archs) -> None:
    results = {}
    for case_id, fn, args in cases():
        if args[0] not in archs:
            continue
        t0 = time.perf_counter()
        try:
            fn(*args)
            results[case_id] = "ok"
        except Exception:  # report every failing case, not only the first
            results[case_id] = traceback.format_exc()[-2000:]
        print(f"{case_id}: {results[case_id][:200]} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    os.environ.pop("TRITON_INTERPRET", None)
    main([int(a) for a in sys.argv[1:]] or ARCHS)  # PYTHONPATH=. python tests/test_kernels_aot.py [90] [80]
