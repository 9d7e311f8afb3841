"""Build FlashInfer's JIT module of the NOSA slot-decode variant (nosa.kernels.flashinfer_decode)
ahead of first use, and report how it went as JSON.

    python scripts/build_flashinfer_variant.py --out results/gpu/flashinfer_build.json   # GPU machine
    CUDA_HOME=/usr/local/cuda python scripts/build_flashinfer_variant.py --compile-only --arch 9.0a
                                                              # no GPU: nvcc compiles, nothing is linked

On a GPU (gpu_check.sh) it builds and loads the module once, so the tests and the benchmark find it
in FlashInfer's JIT cache. With --compile-only (a machine with nvcc and the flashinfer package but
no GPU or driver) it compiles the generated sources for the given architecture and stops before
the link, which needs libcuda: this is how the variant's C++ is checked against FlashInfer's
templates without a GPU. Needs flashinfer-python (see FLASHINFER_VERSION) and nvcc.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from nosa.bench.results import write_result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--arch", default="", help="FLASHINFER_CUDA_ARCH_LIST, e.g. '9.0a' (default: the GPU's)")
    parser.add_argument("--compile-only", action="store_true", help="compile the objects, skip link and load")
    parser.add_argument("--out", default="results/flashinfer_build.json")
    args = parser.parse_args()
    if args.arch:
        os.environ["FLASHINFER_CUDA_ARCH_LIST"] = args.arch
    import torch

    from nosa.kernels import flashinfer_decode as fd

    result = {"module": None, "compile_only": args.compile_only, "arch": args.arch or "device",
              "cuda_home": os.environ.get("CUDA_HOME", "")}
    t0 = time.perf_counter()
    try:
        fi = fd.require_flashinfer()
        from flashinfer.jit import gen_customize_batch_decode_module

        result["flashinfer"] = fi.__version__
        spec = gen_customize_batch_decode_module(*fd.jit_args(getattr(torch, args.dtype), args.head_dim))
        result["module"] = spec.name
        build_dir = spec.ninja_path.parent
        if args.compile_only:  # stale objects of an earlier variant must not pass for this one
            for stale in build_dir.glob("*.o"):
                stale.unlink()
        try:
            spec.build()
            if not args.compile_only:
                spec.load()
            result["ok"] = True
        except Exception as e:
            objects = sorted(p.name for p in build_dir.glob("*.o"))
            result["objects"] = objects
            # compile-only: the link step is expected to fail without libcuda; every source compiled is the check
            result["ok"] = args.compile_only and len(objects) == len(spec.sources)
            result["error"] = repr(e)[-1500:]
    except Exception as e:
        result.update(ok=False, error=repr(e)[-1500:])
    result["seconds"] = round(time.perf_counter() - t0, 1)
    write_result(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "error"}), result.get("error", "")[-400:], sep="\n")
    sys.exit(0 if result["ok"] else 1)


if __name__ == "__main__":
    main()
