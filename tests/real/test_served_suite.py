"""The real model served with offloading, in short: scripts/serve_ask.py --suite asks a suite's
prompts (512 tokens) through /v1/chat/completions of an SGLang server with offloading on and a
device budget of a quarter of each prompt's blocks; every served reply equals the greedy reply of
the HF NOSA model (nosa.from_pretrained) of the same checkpoint and NosaConfig.

- the project's suite (nosa.train.ruler) on SmolLM2 converted to NOSA with random eviction heads
  (A != 0), so that the served selection goes through the heads and not only the training-free part;
- NVIDIA's RULER (--suite ruler) on the sparse-aware fine-tune (configs/train/smollm2-sparse.yaml,
  one step at a toy size: tests/real/conftest.py), with dense's answers beside the served ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real
pytest.importorskip("sglang")
from nosa.bench import tiny_checkpoint as tiny  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LENGTH, SHARE, TASKS = 512, 4, ("passkey", "qa")
PICKS = "15/64"  # the released split: 1 of the 4 blocks is a query-aware pick (the default 1/16 rounds to none)


def serve_ask(checkpoint: str, tmp_path, *args: str) -> dict:
    """scripts/serve_ask.py on ``checkpoint`` at LENGTH and 1/SHARE, 3 prompts at once, a device
    budget of 2 requests, and ``args``; its JSON summary."""
    out = tmp_path / "summary.json"
    cmd = [sys.executable, "scripts/serve_ask.py", "--checkpoint", checkpoint, "--length", str(LENGTH), "--share",
           str(SHARE), "--picks", PICKS, "--concurrency", "3", "--device-requests", "2", "--out", str(out),
           "--plot", "", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def random_heads_checkpoint(dense_model_once, real_tokenizer, tmp_path_factory):
    if tiny.cpu_engine_missing():
        pytest.skip(tiny.cpu_engine_missing())
    import copy

    import nosa
    from nosa.bench.longctx.config import budget_config, picks_share
    from nosa.tiny import set_eviction_heads

    model = copy.deepcopy(dense_model_once)
    nosa.convert(model, budget_config(LENGTH, SHARE, picks_share(PICKS)))
    assert model.config.nosa["query_blocks"] == 1
    set_eviction_heads(model, scale=0.5, std=0.3, seed=0, bias_std=0.3)
    path = tmp_path_factory.mktemp("smollm2") / "nosa"
    model.save_pretrained(path)
    real_tokenizer.save_pretrained(path)
    return str(path)


def test_served_replies_equal_the_hf_nosa_model(random_heads_checkpoint, real_tokenizer, tmp_path):
    import torch

    import nosa
    from nosa.bench.longctx.chat import suite_examples

    summary = serve_ask(random_heads_checkpoint, tmp_path, "--suite", "--tasks", *TASKS)
    served = summary["answers"]
    assert [a["label"] for a in served] == list(TASKS)

    model = nosa.from_pretrained(random_heads_checkpoint).eval()
    assert model.config.nosa["topk_blocks"] * SHARE * 32 == LENGTH  # the same NosaConfig as the server's
    examples = suite_examples(real_tokenizer, TASKS, LENGTH, 1)
    for ex, answer in zip(examples, served):
        assert answer["served_prompt_tokens"] == len(ex.prompt_ids)  # the chat messages gave the suite's prompt
        ids = torch.tensor([ex.prompt_ids])
        with torch.no_grad():
            reply = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=ex.max_new_tokens,
                                   do_sample=False, pad_token_id=real_tokenizer.eos_token_id)
        hf = real_tokenizer.decode(reply[0, ids.shape[1]:], skip_special_tokens=True)
        assert answer["reply"] == hf, (ex.task, answer["reply"], hf)

    # offloading was on and sparse: a request held a quarter of its blocks, recalled the rest
    assert summary["device_tokens_per_request"] * SHARE == LENGTH
    assert summary["peak_device_tokens"] <= summary["device_budget_tokens"] < summary["prompt_tokens"]
    assert summary["decode_layer_steps"] > 0 and summary["recalled_items"] > 0
    assert summary["requests_after"] == 0 and summary["device_slots_in_use_after"] == 0


RULER_TASKS = ("niah_single_1", "niah_multivalue")  # one reference and four; RULER's vt cannot fit 512 tokens


def test_served_ruler_replies_of_the_fine_tune_equal_the_hf_nosa_model(sparse_ft_checkpoint, real_checkpoint,
                                                                       real_tokenizer, dense_model_once, tmp_path):
    import torch

    import nosa
    from nosa.bench.longctx.suites import make_suite
    from nosa.config import NosaConfig

    cfg, _ = sparse_ft_checkpoint
    checkpoint = os.path.join(cfg.out_dir, "nosa")
    data, cache = tmp_path / "ruler-data", tmp_path / "cache"
    summary = serve_ask(checkpoint, tmp_path, "--suite", "ruler", "--tasks", *RULER_TASKS, "--ruler-data", str(data),
                        "--dense", real_checkpoint, "--cache", str(cache))
    served = summary["answers"]
    assert summary["suite"] == "ruler" and [a["label"] for a in served] == list(RULER_TASKS)

    model = nosa.from_pretrained(checkpoint).eval()
    nosa.convert(model, NosaConfig.from_dict(summary["nosa_config"]))  # served: the suite's budget at 512, its heads
    assert model.config.nosa["topk_blocks"] * SHARE * 32 == LENGTH
    suite = make_suite("ruler", RULER_TASKS, data_dir=str(data))
    examples = suite.examples(real_tokenizer, checkpoint, LENGTH, 1, 42)
    for ex, answer in zip(examples, served):
        assert answer["served_prompt_tokens"] == len(ex.prompt_ids)
        ids = torch.tensor([ex.prompt_ids])
        replies = []
        for m in (model, dense_model_once):
            with torch.no_grad():
                reply = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=ex.max_new_tokens,
                                   do_sample=False, pad_token_id=real_tokenizer.eos_token_id)
            replies.append(real_tokenizer.decode(reply[0, ids.shape[1]:], skip_special_tokens=True))
        assert answer["reply"] == replies[0], (ex.task, answer["reply"], replies[0])
        assert answer["score"] == suite.score(answer["reply"], ex)  # RULER's own metric
        # dense's answer beside it: the benchmark's dense greedy reply (it stops once fully right)
        assert replies[1].startswith(answer["dense"]["reply"].rstrip()), (ex.task, answer["dense"], replies[1])
    assert summary["dense_score"] == sum(a["dense"]["right"] for a in served) / len(served)
    assert summary["requests_after"] == 0 and summary["device_slots_in_use_after"] == 0
    assert summary["recalled_items"] > 0 and summary["peak_device_tokens"] < summary["prompt_tokens"]
    # the dense answers went into the benchmark's cache: a second run reads them back
    assert len(json.loads(next(cache.glob("dense-*.json")).read_text())) == len(RULER_TASKS)

