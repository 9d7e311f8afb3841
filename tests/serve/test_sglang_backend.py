"""The "nosa" SGLang attention backend, end to end on CPU: real servers on 127.0.0.1, tiny models.

Servers started in parallel (--sleep-on-idle: an idle SGLang scheduler otherwise keeps a core busy):
- ``nosa``: the session's ``nosa_server`` (tests/serve/conftest.py): the NOSA checkpoint (random
  non-zero eviction heads, tiny NosaConfig with dense_len 64), chunked prefill of 128 tokens, radix
  cache on, context length 4096 (the NOSA format: model_type nosa_llama, architecture
  NosaLlamaForCausalLM; the legacy format, model_type llama with a 'nosa' section, is served through
  sglang.Engine in test_engine.py);
- ``native``: the session's ``native_server``: the same checkpoint with --attention-backend torch_native;
- ``dense``: a dense checkpoint, NosaConfig from $NOSA_CONFIG, page size 4;
- ``decode_only``: the NOSA checkpoint with --prefill-attention-backend torch_native
  --decode-attention-backend nosa (decode states built from a pool nosa never wrote);
- ``malformed``: a checkpoint with an invalid 'nosa' section, which must fail at start-up.
Decode-state accounting is read from the file the backend writes when $NOSA_SERVE_STATS_FILE is set.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("sglang")
from nosa.bench import tiny_checkpoint as tiny  # noqa: E402

_MISSING = tiny.cpu_engine_missing()
if _MISSING:
    pytest.skip(_MISSING, allow_module_level=True)

import torch  # noqa: E402

import nosa  # noqa: E402
from nosa.bench.server.process import ServerProcess, stop_all  # noqa: E402

NOSA_CFG = nosa.NosaConfig.tiny(dense_len=64)  # budget 8 blocks x 16 tokens = 128 tokens
CONTEXT_LEN = 1024  # of this module's own servers
COMMON = ["--skip-server-warmup", "--sleep-on-idle", "--dtype", "float32", "--max-total-tokens", "8192",
          "--mem-fraction-static", "0.3", "--context-length", str(CONTEXT_LEN)]
LONG = [(300, 11), (457, 12), (333, 13)]  # (prompt length, seed): 4-7x dense_len, >2x the budget
NEW = 12


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, tiny_nosa_checkpoint):
    root = tmp_path_factory.mktemp("ckpt")
    out = {
        "nosa": tiny_nosa_checkpoint,
        "dense": tiny.make_checkpoint(str(root / "dense"), None, seed=1),
    }
    with open(os.path.join(out["nosa"], "config.json")) as f:
        assert json.load(f)["model_type"] == "nosa_llama"
    return out


def _malformed_copy(ckpt: str, dest) -> str:
    """The checkpoint with an invalid 'nosa' section (topk_blocks smaller than the forced blocks)."""
    dest.mkdir()
    for name in os.listdir(ckpt):
        if name != "config.json":
            os.symlink(os.path.join(ckpt, name), dest / name)
    with open(os.path.join(ckpt, "config.json")) as f:
        config = json.load(f)
    config["nosa"]["topk_blocks"] = 2
    (dest / "config.json").write_text(json.dumps(config))
    return str(dest)


@pytest.fixture(scope="module")
def servers(ckpts, tmp_path_factory, nosa_server, native_server):
    logs = tmp_path_factory.mktemp("logs")
    bad = _malformed_copy(ckpts["nosa"], logs / "bad_ckpt")
    own = {
        "malformed": ServerProcess(bad, ["--attention-backend", "nosa", *COMMON], str(logs / "bad.log")),
        "dense": ServerProcess(ckpts["dense"], ["--attention-backend", "nosa", "--page-size", "4", *COMMON],
                               str(logs / "dense.log"), env={"NOSA_CONFIG": NOSA_CFG.to_json()}),
        "decode_only": ServerProcess(ckpts["nosa"], ["--prefill-attention-backend", "torch_native",
                                                     "--decode-attention-backend", "nosa", *COMMON],
                                     str(logs / "decode_only.log")),
    }
    procs = {**own, "nosa": nosa_server, "native": native_server}
    try:
        for name, p in procs.items():
            if name != "malformed":
                p.wait_ready(timeout=600)  # several servers start at once on a shared 2-core machine
        yield procs
    finally:
        stop_all(own.values())


@pytest.fixture(scope="module")
def hf_models(ckpts):
    return {
        "nosa": nosa.from_pretrained(ckpts["nosa"], torch_dtype=torch.float32).eval(),
        "dense": nosa.from_pretrained(ckpts["dense"], NOSA_CFG, torch_dtype=torch.float32).eval(),
    }


def test_short_prompts_match_torch_native(servers):
    """Contexts within dense_len attend densely: same tokens as SGLang's own dense backend."""
    for length, seed in [(5, 1), (23, 2), (40, 3)]:
        prompt = tiny.prompt_ids(length, seed)
        new = NOSA_CFG.dense_len - length  # prompt + generated stays within dense_len
        assert servers["nosa"].generate(prompt, new) == servers["native"].generate(prompt, new)


@pytest.mark.parametrize("name", ["nosa", "dense"])
def test_long_prompts_match_hf(servers, hf_models, name):
    """Budget well below the context: the same blocks as the HF model (train == serve)."""
    differs_from_dense = False
    for length, seed in LONG:
        prompt = tiny.prompt_ids(length, seed)
        served = servers[name].generate(prompt, NEW)
        assert served == tiny.hf_greedy(hf_models[name], prompt, NEW), f"length {length}"
        if name == "nosa":
            differs_from_dense |= served != servers["native"].generate(prompt, NEW)
    if name == "nosa":  # otherwise the test could not tell sparse from dense attention
        assert differs_from_dense


def test_decode_attention_backend_alone_matches_hf(servers, hf_models):
    """--decode-attention-backend nosa after a torch_native prefill: the HF model with a dense (sdpa)
    prefill and NOSA decode steps gives the same tokens."""
    for length, seed in LONG:
        prompt = tiny.prompt_ids(length, seed)
        want = tiny.hf_greedy(hf_models["nosa"], prompt, NEW, prefill_attention="sdpa")
        assert servers["decode_only"].generate(prompt, NEW) == want, f"prompt length {length}"


def test_prefix_cache_hit_matches_hf(servers, hf_models):
    """A request whose prompt extends a cached one: extend over the cached prefix."""
    base = tiny.prompt_ids(400, 21)
    servers["nosa"].generate(base, 2)
    prompt = base + tiny.prompt_ids(37, 22)
    status, body = servers["nosa"].post("/generate", {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": NEW, "ignore_eos": True},
    })
    assert status == 200, body
    assert body["meta_info"]["cached_tokens"] >= 256, body["meta_info"]
    assert body["output_ids"] == tiny.hf_greedy(hf_models["nosa"], prompt, NEW)


def test_concurrent_mixed_lengths_match_sequential(servers):
    server = servers["nosa"]
    prompts = [tiny.prompt_ids(n, 100 + i) for i, n in enumerate([7, 50, 130, 260, 33, 410, 90, 199])]
    server.post("/flush_cache", {})
    with ThreadPoolExecutor(len(prompts)) as pool:
        together = list(pool.map(lambda p: server.generate(p, NEW), prompts))
    server.post("/flush_cache", {})
    alone = [server.generate(p, NEW) for p in prompts]
    assert together == alone


def _stats(server) -> dict:
    with open(server.stats_path) as f:
        return json.load(f)


def _wait_stats(server, predicate, timeout=30.0) -> dict:
    deadline = time.time() + timeout
    while True:
        stats = _stats(server)
        if predicate(stats) or time.time() > deadline:
            return stats
        time.sleep(0.2)


def test_finished_and_aborted_requests_leave_no_state(servers):
    server = servers["nosa"]
    server.generate(tiny.prompt_ids(200, 31), 4)
    stats = _wait_stats(server, lambda s: s["requests"] == 0, timeout=5)
    assert stats["requests"] == 0 and stats["layer_states"] == 0, stats
    freed_before = stats["freed_total"]

    rids = [f"abort-{i}" for i in range(6)]
    results = {}

    def run(i, rid):
        results[rid] = server.post("/generate", {
            "rid": rid, "input_ids": tiny.prompt_ids(150 + 20 * i, 40 + i),
            "sampling_params": {"temperature": 0.0, "max_new_tokens": 700, "ignore_eos": True},
        })

    threads = [threading.Thread(target=run, args=(i, rid)) for i, rid in enumerate(rids)]
    for t in threads:
        t.start()
    busy = _wait_stats(server, lambda s: s["requests"] >= 3, timeout=60)
    assert busy["requests"] >= 3, busy  # decode states exist while requests run
    for rid in rids:
        server.post("/abort_request", {"rid": rid})
    for t in threads:
        t.join(timeout=120)
    assert all(len(results[rid][1]["output_ids"]) < 700 for rid in rids if results[rid][0] == 200)
    stats = _wait_stats(server, lambda s: s["requests"] == 0)
    assert stats["requests"] == 0 and stats["layer_states"] == 0, stats
    # every request that held decode state freed it (a request aborted while still queued, which
    # happens on a loaded machine, never had any)
    assert stats["freed_total"] >= freed_before + busy["requests"]
    assert len(server.generate(tiny.prompt_ids(20, 50), 3)) == 3


def test_prompt_longer_than_context_is_rejected_clearly(servers):
    server = servers["nosa"]
    status, body = server.post("/generate", {
        "input_ids": tiny.prompt_ids(server.context_length + 100, 60),
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 4},
    })
    assert status == 400, (status, body)
    assert "context length" in json.dumps(body).lower() or "exceeds" in json.dumps(body).lower(), body
    prompt = tiny.prompt_ids(30, 61)
    assert server.generate(prompt, 5) == servers["native"].generate(prompt, 5)



def test_malformed_nosa_section_fails_at_start_up(servers):
    with pytest.raises(RuntimeError, match="malformed 'nosa' section .*topk_blocks=2"):
        servers["malformed"].wait_ready(timeout=120)
