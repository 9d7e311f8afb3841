"""Gemma 3 270M (python -m nosa.models gemma3-270m): the written checkpoint and its <bos>, NOSA on
its three full-attention layers (the fifteen sliding-window ones untouched) against the HF model,
decode against prefill, and the save / nosa.from_pretrained round trip. One prompt of 700 tokens:
past the 512-token window, so the sliding layers' cache is a window, and 22 blocks of 32, so a
budget of 8 blocks is sparse."""

import copy
import json
import os

import pytest
import torch

import nosa
from nosa import models
from nosa.bench.longctx import nvidia_ruler
from nosa.chat import chat_text
from nosa.tiny import set_eviction_heads

pytestmark = pytest.mark.real

SPARSE = nosa.NosaConfig(block_size=32, compress_kernel=32, compress_stride=16, window_blocks=2, query_blocks=1,
                         topk_blocks=8, dense_len=0)


@pytest.fixture(scope="module")
def prompt(gemma_once):
    _, tokenizer = gemma_once
    colours = ["red", "blue", "green"]
    text = " ".join(f"Line {i}: the {colours[i % 3]} box holds {i * 7 % 97} marbles." for i in range(60))
    ids = tokenizer(text + " Which box holds 42 marbles? Line", return_tensors="pt").input_ids[:, -700:]
    ids[0, 0] = tokenizer.bos_token_id
    return ids


def test_checkpoint_says_what_it_is_and_prepends_bos(gemma_checkpoint, gemma_once):
    _, tokenizer = gemma_once
    record = models.source(gemma_checkpoint)
    assert record["quantization"] == "Q4_K_M" and "Gemma Terms of Use" in record["weights"]
    assert "Paris" in record["check_reply"]
    for name in ("GEMMA_TERMS.html", "NOTICE.md", "config.json", "tokenizer.json"):
        assert os.path.isfile(os.path.join(gemma_checkpoint, name)), name
    config = json.load(open(os.path.join(gemma_checkpoint, "config.json")))
    assert config["model_type"] == "gemma3_text" and config["layer_types"].count("full_attention") == 3
    assert tokenizer("The capital of France is")["input_ids"][0] == tokenizer.bos_token_id == 2
    lines = []
    assert models.fetch("gemma3-270m", gemma_checkpoint, log=lines.append) == gemma_checkpoint
    assert "nothing to do" in lines[0]


def test_full_budget_conversion_equals_dense_and_sparse_touches_only_full_layers(gemma_once, prompt):
    dense_model, _ = gemma_once
    model = copy.deepcopy(dense_model)
    with torch.no_grad():
        dense = model(prompt, output_hidden_states=True)
        nosa.convert(model, nosa.NosaConfig(**{**SPARSE.to_dict(), "topk_blocks": 23}))  # every block: A = 0
        full = model(prompt).logits
        torch.testing.assert_close(full, dense.logits, atol=2e-3, rtol=1e-3)
        nosa.convert(model, SPARSE)
        set_eviction_heads(model, scale=0.5, std=0.3, seed=1)
        sparse = model(prompt, output_hidden_states=True)
    assert [name for name, _ in nosa.hf.nosa_attention_modules(model)] == [
        f"model.layers.{i}.self_attn" for i in (5, 11, 17)]
    for i in range(6):  # layers 0-4 are sliding (hidden_states[i + 1] is layer i's output): exact
        torch.testing.assert_close(sparse.hidden_states[i], dense.hidden_states[i], atol=0, rtol=0)
    assert (sparse.hidden_states[6] - dense.hidden_states[6]).abs().max() > 1e-3  # layer 5 (full): sparse


@pytest.fixture(scope="module")
def sparse(gemma_once, tmp_path_factory):
    """(the NOSA model at SPARSE with eviction heads A != 0, its checkpoint with the tokenizer): one
    conversion and one save for the round trip and the served test."""
    dense_model, tokenizer = gemma_once
    model = nosa.convert(copy.deepcopy(dense_model), SPARSE).eval()
    set_eviction_heads(model, scale=0.5, std=0.3, seed=1)
    path = tmp_path_factory.mktemp("gemma-nosa") / "nosa"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model, path


def test_sparse_decode_equals_prefill_and_round_trips(sparse, prompt):
    model, path = sparse
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12, min_new_tokens=12,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        logits = model(out.sequences).logits
    assert torch.equal(logits[:, prompt.shape[1] - 1:-1].argmax(-1), out.sequences[:, prompt.shape[1]:])
    torch.testing.assert_close(torch.stack(out.logits, 1), logits[:, prompt.shape[1] - 1:-1], atol=2e-3, rtol=1e-3)
    assert json.load(open(path / "config.json"))["model_type"] == "nosa_gemma3_text"
    loaded = nosa.from_pretrained(str(path)).eval()
    with torch.no_grad():
        assert torch.equal(loaded(prompt).logits, model(prompt).logits)


def test_served_with_offloading_equals_the_hf_nosa_model(sparse, prompt, tmp_path):
    """SGLang serves the NOSA checkpoint (heads on layers 5, 11, 17) with --attention-backend nosa and
    offloading: the host pool holds the three full layers, the fifteen sliding layers' windows stay on
    the device; the greedy tokens of the 700-token prompt equal the HF NOSA model's."""
    from nosa.bench import tiny_checkpoint as tiny
    from nosa.bench.server.process import ServerProcess, stop_all

    if tiny.cpu_engine_missing():
        pytest.skip(tiny.cpu_engine_missing())
    model, path = sparse
    env = {"NOSA_OFFLOAD": "1", "NOSA_HOST_KV_TOKENS": "4096", "NOSA_DEVICE_KV_TOKENS": "1024",
           "NOSA_RECALL_SCHEDULER": "1", "NOSA_SERVE_STATS_FILE": str(tmp_path / "stats.json")}
    # a high static fraction: SGLang checks the weights (1.1 GB in fp32) against the memory free at
    # start-up, which the rest of the suite shares; the KV pool itself is the host pool's 4096 tokens
    server = ServerProcess(str(path), [
        "--attention-backend", "nosa", "--skip-server-warmup", "--sleep-on-idle", "--dtype", "float32",
        "--context-length", "2048", "--page-size", str(SPARSE.block_size), "--disable-radix-cache",
        "--chunked-prefill-size", "512", "--mem-fraction-static", "0.8"], str(tmp_path / "server.log"), env=env)
    try:
        server.wait_ready(timeout=600)
        ids = prompt[0].tolist()
        want = tiny.hf_greedy(model, ids, 8)
        assert server.generate(ids, 8) == want
        log = server.log_tail(200_000)
        assert "15 sliding-window layers (window 512) on the device" in log
    finally:
        stop_all([server])
    with open(tmp_path / "stats.json") as f:
        stats = json.load(f)
    assert stats["requests"] == 0 and stats["device_slots_in_use"] == 0 and sum(stats["offload"]["misses"]) > 0


def test_a_base_model_gets_rulers_base_template(gemma_checkpoint, gemma_once, tmp_path):
    """NVIDIA's RULER on a base model: Gemma 3 270M has no chat template, so its RULER prompt is stock
    RULER's ``base`` template, one <bos> then the generator's text with the answer prefix right after
    the question, as RULER writes it. (Here rather than in test_nvidia_ruler.py: this module's group
    has Gemma loaded already.)"""
    _, tokenizer = gemma_once
    assert not tokenizer.chat_template
    assert chat_text(tokenizer, "Hi") == "<bos>Hi\n"
    suite = nvidia_ruler.RulerSuite(("niah_single_1",), data_dir=str(tmp_path))
    (ex,) = suite.examples(tokenizer, gemma_checkpoint, 1024, 1, nvidia_ruler.SEED)
    assert ex.prompt_ids.count(tokenizer.bos_token_id) == 1 and ex.prompt_ids[0] == tokenizer.bos_token_id
    assert len(ex.prompt_ids) + ex.max_new_tokens <= 1024
    (row,) = nvidia_ruler.generate(suite.configs["niah_single_1"], gemma_checkpoint, 0, 1, 0,
                                   str(next(tmp_path.glob("*/*"))))  # read back, the limit is not used
    stock = row["input"].replace(nvidia_ruler._MARK, "")  # RULER's base template: task text + answer prefix
    assert tokenizer.decode(ex.prompt_ids) == "<bos>" + stock
    assert stock.endswith("mentioned in the provided text? The special magic number for "
                          f"{stock.split('number for ')[-1].split(' mentioned')[0]} mentioned in the provided text is")
    question = tokenizer.decode(ex.prompt_ids[ex.context_end:])
    assert question.startswith("\nWhat is the special magic number") and ex.references[0] not in question
