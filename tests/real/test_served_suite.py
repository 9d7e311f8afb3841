"""The real model served with offloading, in short: scripts/serve_ask.py --suite ruler asks NVIDIA's
RULER prompts (512 tokens) through /v1/chat/completions of an SGLang server with offloading on and a
device budget of a quarter of each prompt's blocks; every served reply equals the greedy reply of the
HF NOSA model (nosa.from_pretrained) of the same checkpoint and NosaConfig, with dense's answers
beside the served ones. The checkpoint is the sparse-aware fine-tune (configs/train/smollm2-sparse.yaml,
one step at a toy size: tests/real/conftest.py), whose fitted eviction heads are non-zero (A != 0), so
the served selection goes through the heads and not only the training-free part. (The project's own
suite takes the same path through serve_ask with another prompt builder, nosa.bench.longctx.chat,
tested on its own in tests/real/test_bench_longctx.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.real
pytest.importorskip("sglang")

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


def test_suite_prompts_travel_as_chat_messages_that_render_back_to_them(real_tokenizer):
    """serve_ask --suite (the project's suite): each prompt goes to the server as a user message and the
    answer prefix, which the model's chat template (as SGLang applies it, continuing the final message)
    renders back to the suite's prompt; a prompt that is not one chat turn is refused."""
    from nosa.bench.longctx.chat import chat_messages, suite_examples

    examples = suite_examples(real_tokenizer, TASKS, LENGTH, 1)
    assert [ex.task for ex in examples] == list(TASKS)
    for ex in examples:
        messages = chat_messages(real_tokenizer, ex.prompt_ids)
        assert [m["role"] for m in messages] == ["user", "assistant"] and messages[1]["content"]
        text = real_tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
        assert real_tokenizer.encode(text, add_special_tokens=False) == list(ex.prompt_ids), ex.task
    with pytest.raises(ValueError, match="not one user turn"):
        chat_messages(real_tokenizer, real_tokenizer.encode("plain text, no chat turn", add_special_tokens=False))


# Examples of one task: one generator run (each costs ~20 s of RULER's start-up here) and short replies
# (niah_multivalue's four references had the toy fine-tune babble all 128 tokens, decoded twice over).
# RULER's scoring of several references is tested in test_nvidia_ruler.py.
RULER_TASKS, PER_TASK = ("niah_single_1",), 3  # 3 prompts at once against a device budget of 2 requests
MAX_TOKENS = 24  # the replies capped (serve_ask --max-tokens): a 7-digit answer and some decode steps after it


def test_served_ruler_replies_of_the_fine_tune_equal_the_hf_nosa_model(sparse_ft_checkpoint, real_checkpoint,
                                                                       real_tokenizer, dense_model_once, tmp_path):
    import torch

    import nosa
    from nosa.bench.longctx.suites import make_suite
    from nosa.config import NosaConfig
    from nosa.eviction import EvictionHead

    cfg, _ = sparse_ft_checkpoint
    checkpoint = os.path.join(cfg.out_dir, "nosa")
    data, cache = tmp_path / "ruler-data", tmp_path / "cache"
    summary = serve_ask(checkpoint, tmp_path, "--suite", "ruler", "--tasks", *RULER_TASKS, "--ruler-data", str(data),
                        "--per-task", str(PER_TASK), "--dense", real_checkpoint, "--cache", str(cache),
                        "--max-tokens", str(MAX_TOKENS))
    served = summary["answers"]
    assert summary["suite"] == "ruler"
    assert [a["label"] for a in served] == [t for t in RULER_TASKS for _ in range(PER_TASK)]

    model = nosa.from_pretrained(checkpoint).eval()
    heads = [m for m in model.modules() if isinstance(m, EvictionHead)]
    assert heads and max(float(h.scale.detach().abs().max()) for h in heads) > 0  # fitted heads: A != 0 selects too
    nosa.convert(model, NosaConfig.from_dict(summary["nosa_config"]))  # served: the suite's budget at 512, its heads
    assert model.config.nosa["topk_blocks"] * SHARE * 32 == LENGTH
    suite = make_suite("ruler", RULER_TASKS, data_dir=str(data))
    examples = suite.examples(real_tokenizer, checkpoint, LENGTH, PER_TASK, 42)
    for ex, answer in zip(examples, served):
        assert answer["served_prompt_tokens"] == len(ex.prompt_ids)
        ids = torch.tensor([ex.prompt_ids])
        replies = []
        # served: capped at MAX_TOKENS; dense: the benchmark's reply (it stops once fully right) and a bit
        dense_tokens = len(real_tokenizer.encode(answer["dense"]["reply"], add_special_tokens=False)) + 2
        for m, new in ((model, min(ex.max_new_tokens, MAX_TOKENS)), (dense_model_once, dense_tokens)):
            with torch.no_grad():
                reply = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                                   pad_token_id=real_tokenizer.eos_token_id)
            replies.append(real_tokenizer.decode(reply[0, ids.shape[1]:], skip_special_tokens=True))
        assert answer["reply"] == replies[0], (ex.task, answer["reply"], replies[0])
        assert answer["score"] == suite.score(answer["reply"], ex)  # RULER's own metric
        # dense's answer beside it: the benchmark's dense greedy reply (it stops once fully right)
        assert replies[1].startswith(answer["dense"]["reply"].rstrip()), (ex.task, answer["dense"], replies[1])
    assert summary["dense_score"] == sum(a["dense"]["right"] for a in served) / len(served)
    assert summary["requests_after"] == 0 and summary["device_slots_in_use_after"] == 0
    # offloading was on and sparse: a request held a quarter of its blocks, recalled the rest
    assert summary["device_tokens_per_request"] * SHARE == LENGTH
    assert summary["peak_device_tokens"] <= summary["device_budget_tokens"] < summary["prompt_tokens"]
    assert summary["decode_layer_steps"] > 0 and summary["recalled_items"] > 0
    # the dense answers went into the benchmark's cache: a second run reads them back
    assert len(json.loads(next(cache.glob("dense-*.json")).read_text())) == len(served)

