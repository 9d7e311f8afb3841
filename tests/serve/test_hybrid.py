"""A hybrid model served by the nosa backend: a tiny Gemma 3 (sliding window of 64 tokens, then full
attention, twice; random non-zero eviction heads on the two full layers) against the HF NOSA model.

- ``off``: offloading off (every layer's KV in SGLang's pool; sliding layers read their window from
  it), chunked prefill of 64 tokens (chunks shorter than a prompt, and than the window), radix cache
  on (the second request of a pair hits the first one's prefix);
- ``on``: offloading with the recall scheduler and admission: the host pool holds the two full layers
  only, the sliding layers' windows live in a device ring per request;
- ``radix``: offloading with the radix cache left on, which must stop at start-up naming the flag.
Prompts of 40 (within the window), 130, 300 and 457 tokens (past the window and NOSA's budget of
128 tokens), 12 new tokens each, sent at once so that decode steps batch several requests.
"""

from __future__ import annotations

import json
import os
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

CFG = nosa.NosaConfig.tiny(dense_len=64)  # budget 8 blocks x 16 tokens = 128 tokens per request
COMMON = ["--skip-server-warmup", "--sleep-on-idle", "--dtype", "float32", "--mem-fraction-static", "0.3",
          "--context-length", "1024", "--attention-backend", "nosa", "--chunked-prefill-size", "64"]
OFFLOAD = {"NOSA_OFFLOAD": "1", "NOSA_HOST_KV_TOKENS": "3000", "NOSA_DEVICE_KV_TOKENS": "512",
           "NOSA_RECALL_SCHEDULER": "1", "NOSA_ADMISSION": "1", "NOSA_DEVICE_EXTRA_SLOTS": "2"}
PROMPTS = [(40, 1), (130, 8), (300, 2), (457, 3)]
NEW = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tiny.make_checkpoint(str(tmp_path_factory.mktemp("gemma") / "nosa"), CFG, seed=0, evict_scale=1.0,
                                model_type="gemma3_text", window=64)
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "nosa_gemma3_text" and config["layer_types"][:2] == ["sliding_attention",
                                                                                        "full_attention"]
    return path


@pytest.fixture(scope="module")
def servers(ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    offload = [*COMMON, "--page-size", str(CFG.block_size), "--disable-radix-cache"]
    procs = {
        # a pool of its own size: SGLang's CPU default takes 30% of free memory (5 GB here), and three
        # servers start at once beside the other test worker's
        "off": ServerProcess(ckpt, [*COMMON, "--max-total-tokens", "4096"], str(logs / "off.log")),
        "on": ServerProcess(ckpt, offload, str(logs / "on.log"),
                            env={**OFFLOAD, "NOSA_SERVE_STATS_FILE": str(logs / "on.json")}),
        "radix": ServerProcess(ckpt, [*COMMON, "--page-size", str(CFG.block_size)], str(logs / "radix.log"),
                               env=OFFLOAD),
    }
    try:
        for name in ("off", "on"):
            procs[name].wait_ready(timeout=600)  # three servers start at once on a shared 2-core machine
        yield {**procs, "on_stats": str(logs / "on.json")}
    finally:
        stop_all(procs.values())


@pytest.fixture(scope="module")
def expected(ckpt):
    model = nosa.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    return [tiny.hf_greedy(model, tiny.prompt_ids(n, seed), NEW) for n, seed in PROMPTS]


def _served(server, prompts):
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: server.generate(p, NEW), prompts))


@pytest.mark.parametrize("name", ["off", "on"])
def test_served_greedy_tokens_equal_the_hf_nosa_model(servers, expected, name):
    prompts = [tiny.prompt_ids(n, seed) for n, seed in PROMPTS]
    assert _served(servers[name], prompts) == expected
    if name == "off":  # the radix cache: each prompt with 3 of its tokens, a prefix hit of its first run
        again = _served(servers[name], [p + e[:3] for p, e in zip(prompts, expected)])
        assert [got[: NEW - 3] for got in again] == [e[3:] for e in expected]


def test_offloading_sizes_the_host_pool_for_the_full_layers_and_frees_everything(servers):
    log = servers["on"].log_tail(200_000)
    assert "2 sliding-window layers (window 64) on the device" in log
    with open(servers["on_stats"]) as f:
        stats = json.load(f)
    assert stats["requests"] == 0 and stats["device_slots_in_use"] == 0
    assert sum(stats["offload"]["misses"]) > 0  # blocks were recalled from the host pool


def test_offloading_with_the_radix_cache_stops_naming_the_flag(servers):
    with pytest.raises(RuntimeError) as err:
        servers["radix"].wait_ready(timeout=300)
    assert "needs --disable-radix-cache" in str(err.value)
