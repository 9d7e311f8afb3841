"""The quickstart's training config writes a checkpoint that serving accepts as it is.

``python -m nosa.train --config configs/train/tiny.yaml`` (shortened: 2 dense steps, 2 NOSA steps, a
small dataset), then ``runs/.../nosa`` served the way scripts/serve.sh serves it
(``--attention-backend nosa``, float32): the server reads the NosaConfig from the checkpoint and its
greedy tokens and their log-probabilities equal those of ``nosa.from_pretrained``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("sglang")
pytest.importorskip("deepspeed")
pytest.importorskip("datasets")
from nosa.bench import tiny_checkpoint as tiny  # noqa: E402

_MISSING = tiny.cpu_engine_missing()
if _MISSING:
    pytest.skip(_MISSING, allow_module_level=True)

import torch  # noqa: E402

import nosa  # noqa: E402
from nosa.bench.server.process import ServerProcess  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORT = ["dense_steps=2", "curriculum=[]", "steps=2", "distill.rows=8", "distill.steps=2", "eval_every=0",
         "eval_examples=2", "data.synthetic.train_examples=32", "data.synthetic.heldout_examples=4",
         "wandb.mode=disabled", "progress=false"]
NEW = 8


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The NOSA checkpoint of a shortened quickstart run (its `nosa` alias)."""
    tmp = tmp_path_factory.mktemp("train")
    command = [sys.executable, "-m", "nosa.train", "--config", "configs/train/tiny.yaml",
               f"out_dir={tmp}/run", f"data.synthetic.dir={tmp}/data", *SHORT]
    # a one-rank run: not the process-group variables an in-process run (tests/train) leaves behind
    dist_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in dist_vars}
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return os.path.join(tmp, "run", "nosa")


@pytest.fixture(scope="module")
def server(trained, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("logs") / "server.log")
    proc = ServerProcess(trained, ["--attention-backend", "nosa", "--dtype", "float32", "--skip-server-warmup",
                                   "--sleep-on-idle", "--max-total-tokens", "4096", "--mem-fraction-static", "0.3",
                                   "--context-length", "1024"], log)
    try:
        yield proc.wait_ready()
    finally:
        proc.stop()


def test_training_writes_the_nosa_format(trained):
    with open(os.path.join(trained, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "nosa_llama" and config["architectures"] == ["NosaLlamaForCausalLM"]
    assert os.path.isfile(os.path.join(trained, "modeling_nosa.py"))


def test_served_tokens_and_logprobs_equal_the_hf_model(trained, server):
    model = nosa.from_pretrained(trained, torch_dtype=torch.float32).eval()
    assert "from checkpoint" in server.log_tail(200_000)  # NosaConfig and eviction heads of the checkpoint
    vocab = model.config.vocab_size
    for length, seed in [(300, 1), (517, 2)]:  # the tiny config's budget is 32 blocks of 4 tokens
        prompt = [t % vocab for t in tiny.prompt_ids(length, seed)]
        status, body = server.post("/generate", {
            "input_ids": prompt, "return_logprob": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True},
        })
        assert status == 200, body
        want = tiny.hf_greedy(model, prompt, NEW)
        assert body["output_ids"] == want, f"prompt length {length}"
        served = torch.tensor([lp for lp, _, _ in body["meta_info"]["output_token_logprobs"]])
        with torch.no_grad():
            logits = model(torch.tensor([prompt + want[:-1]])).logits[0, len(prompt) - 1:]
        expected = torch.log_softmax(logits.float(), -1)[torch.arange(NEW), torch.tensor(want)]
        torch.testing.assert_close(served, expected, rtol=0, atol=1e-3)
