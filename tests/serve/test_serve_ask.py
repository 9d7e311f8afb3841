"""The quickstart's serving step (scripts/serve_ask.py) in its short form: a smoke checkpoint trained
here on the recall task, served with offloading on, asked through /v1/completions; the summary comes
from the server's own counters and every request state and device slot is released afterwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("sglang")
pytest.importorskip("deepspeed")
from nosa.bench import tiny_checkpoint as tiny  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENV = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")


@pytest.fixture(scope="module")
def smoke_checkpoint(tmp_path_factory):
    if tiny.cpu_engine_missing():
        pytest.skip(tiny.cpu_engine_missing())
    root = tmp_path_factory.mktemp("serve_ask")
    cmd = [sys.executable, "-m", "nosa.train", "--config", "configs/train/smoke.yaml", f"out_dir={root / 'run'}",
           f"data.synthetic.dir={root / 'data'}", "wandb.mode=disabled"]
    done = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return root


def test_serve_ask_answers_and_reports_the_server_counters(smoke_checkpoint):
    root = smoke_checkpoint
    out, plot = root / "summary.json", root / "dashboard.png"
    cmd = [sys.executable, "scripts/serve_ask.py", "--checkpoint", str(root / "run" / "nosa"), "--examples", "2",
           "--after", "3", "--concurrency", "4", "--out", str(out), "--plot", str(plot)]
    scratch = root / "tmp"  # serve_ask's work directory (server log, stats file) goes here, and away after
    scratch.mkdir()
    done = subprocess.run(cmd, cwd=REPO, env={**ENV, "TMPDIR": str(scratch)}, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert not list(scratch.glob("serve_ask-*")), "serve_ask left its work directory behind"
    summary = json.loads(out.read_text())
    assert summary["questions"] == 8  # 2 examples x 4 questions, each answered and printed
    assert done.stdout.count(" ok") + done.stdout.count("WRONG") == 8
    assert "accuracy" in done.stdout and "hit rate" in done.stdout
    # the counters are the server's: 4 decode steps per question (the answer comes from prefill)
    assert summary["decode_layer_steps"] > 0 and summary["recalled_items"] > 0
    assert summary["peak_device_tokens"] <= summary["device_budget_tokens"]  # the budget holds
    assert summary["device_tokens_per_request"] < summary["prompt_tokens"]  # a request holds less than its prompt
    assert summary["max_warm_misses"] <= 2  # smoke config: query_blocks + 1
    assert summary["requests_after"] == 0 and summary["device_slots_in_use_after"] == 0
    assert plot.stat().st_size > 10_000


def test_serve_ask_names_a_missing_checkpoint(tmp_path):
    cmd = [sys.executable, "scripts/serve_ask.py", "--checkpoint", str(tmp_path / "nope")]
    done = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "no checkpoint at" in done.stderr and "nosa.train" in done.stderr
