"""Download FlashInfer's wheels for the lent GPU machine (Python 3.12, no registry there) into .whl/,
and slim the package to what the NOSA decode variant needs, so that the wheels and the working tree
fit the 64 MiB a device call may carry.

    python scripts/flashinfer_wheels.py            # .whl/: flashinfer-python (slimmed) + apache-tvm-ffi
    run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=...)

flashinfer-python 0.7.2.post1 is a 62 MB wheel of 420 MB of sources: JIT-compiled CUDA for every
kernel family it has. The NOSA variant is FlashInfer's customised batch decode
(``flashinfer.jit.gen_customize_batch_decode_module``), which compiles ``batch_decode*.cu`` from
``data/csrc`` against the headers. The slim wheel drops the other ``.cu`` sources of ``data/csrc``
and the non-Python files of the experimental, MoE and prims packages (CUDA sources and cubins of
other kernels); every Python module and every header stays, so ``import flashinfer`` and the decode
JIT see the package as installed. Written as a wheel of the same name: pip installs it as it is
(``--no-deps``; the RECORD still lists the dropped files, which pip does not check on install).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import zipfile

FLASHINFER = "flashinfer-python==0.7.2.post1"  # nosa.kernels.flashinfer_decode.FLASHINFER_VERSION
TVM_FFI = "apache-tvm-ffi==0.1.11"
NON_PYTHON_DROPPED = ("flashinfer/experimental/", "flashinfer/moe_ep/kernel_src", "flashinfer/fused_moe/backends",
                      "flashinfer/prims_ts", "flashinfer/attention/prims_ts")


def dropped(name: str) -> bool:
    """Whether the slim wheel leaves out the wheel member ``name``."""
    if name.startswith("flashinfer/data/csrc/") and name.endswith(".cu"):
        return "batch_decode" not in os.path.basename(name)
    return name.startswith(NON_PYTHON_DROPPED) and not name.endswith(".py")


def slim(path: str) -> tuple[int, int]:
    """Rewrite the wheel at ``path`` without the members ``dropped`` names; its sizes before and after."""
    before = os.path.getsize(path)
    tmp = path + ".slim"
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            if not dropped(info.filename):
                dst.writestr(info, src.read(info.filename))
    os.replace(tmp, path)
    return before, os.path.getsize(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dest", default=".whl", help="where the wheels go (git-ignored)")
    args = parser.parse_args()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
           "--implementation", "cp", "--platform", "manylinux_2_28_x86_64", "-d", args.dest, FLASHINFER, TVM_FFI]
    subprocess.run(cmd, check=True)
    name = FLASHINFER.split("==")
    wheel = os.path.join(args.dest, f"{name[0].replace('-', '_')}-{name[1]}-py3-none-any.whl")
    before, after = slim(wheel)
    total = sum(os.path.getsize(os.path.join(args.dest, f)) for f in os.listdir(args.dest) if f.endswith(".whl"))
    print(f"{wheel}: {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB; all wheels {total / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
