"""Two processes on 127.0.0.1 (torchrun, gloo, ZeRO-2): finite loss, identical parameters."""

import json
import math
import os
import subprocess
import sys

from nosa.net import free_port

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
SMOKE = os.path.join(REPO, "configs", "train", "smoke.yaml")


def test_two_ranks_zero2_stay_identical(tmp_path):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # an in-process run earlier in the session may have set them
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        os.path.join(REPO, "tests", "train", "two_rank_run.py"),
        str(tmp_path),
        SMOKE,
        "steps=2",
        "deepspeed=configs/deepspeed/zero2.json",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = json.loads((tmp_path / "ranks.json").read_text())
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(math.isfinite(r["loss"]) for r in ranks)
    assert ranks[0]["loss"] == ranks[1]["loss"]  # the logged loss is the all-reduced mean
    assert ranks[0]["digest"] == ranks[1]["digest"]
    assert ranks[0]["a_sum"] > 0  # the eviction heads trained
    assert os.path.isdir(tmp_path / "run" / "checkpoints" / "step-000002")
