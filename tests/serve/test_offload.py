"""KV offloading end to end ($NOSA_OFFLOAD=1): real SGLang servers on 127.0.0.1, a tiny NOSA
checkpoint with non-zero eviction heads on every KV head.

- ``on``: host pool of 3000 tokens, device KV budget 256 tokens (two requests of 8 blocks x 16),
  page size = block size, chunked prefill of 128, radix cache on;
- ``off``: the session's ``nosa_server`` (tests/serve/conftest.py): the same checkpoint, the same
  chunked prefill and context length, offloading off (the KV in SGLang's pool);
- ``int8``: ``on`` with an int8 host pool ($NOSA_HOST_KV_DTYPE), on a copy of the checkpoint with
  key factors (nosa.kvquant.KEY_FACTORS_FILE: most channels at the floor, so a server that ignored
  them would answer otherwise);
- ``fp8``: ``on`` with a float8_e4m3fn host pool plus the recall scheduler (chunks of 4 items, so
  prefetches get preempted), admission (each request owns 8 slots, borrows up to 2 more), W&B
  offline logging and SGLang's Prometheus metrics (--enable-metrics). One server for the quantized
  pool and the scheduling (each server costs about 40 CPU-seconds to start): its replies are
  compared with the HF model over the same fp8 round trip without scheduling, so a scheduling bug
  fails them as it would fail a comparison with ``off``.
Counters come from the file the backend writes when $NOSA_SERVE_STATS_FILE is set.
"""

from __future__ import annotations

import json
import shutil
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
from nosa import kv_calibrate, kvquant  # noqa: E402
from nosa.bench.server.process import ServerProcess, stop_all  # noqa: E402

CFG = nosa.NosaConfig.tiny(dense_len=64)  # budget 8 blocks x 16 tokens = 128 tokens per request
HOST, DEVICE = 3000, 256
COMMON = ["--skip-server-warmup", "--sleep-on-idle", "--dtype", "float32", "--mem-fraction-static", "0.3",
          "--context-length", "4096", "--attention-backend", "nosa", "--chunked-prefill-size", "128"]
OFFLOAD_ENV = {"NOSA_OFFLOAD": "1", "NOSA_HOST_KV_TOKENS": str(HOST), "NOSA_DEVICE_KV_TOKENS": str(DEVICE)}
SCHED_ENV = {"NOSA_RECALL_SCHEDULER": "1", "NOSA_RECALL_CHUNK_ITEMS": "4", "NOSA_ADMISSION": "1",
             "NOSA_DEVICE_EXTRA_SLOTS": "2", "NOSA_SERVE_WANDB": "offline"}
LONG = [(300, 11), (457, 12), (40, 3), (333, 13)]  # one dense (40 <= dense_len 64)
NEW = 12


def key_factors_for(ckpt: str) -> dict[int, torch.Tensor]:
    """Key factors for every layer of the tiny checkpoint, as nosa.kvquant.key_factors makes them from
    a range with two large channels: the rest sit at the floor."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(ckpt).get_text_config()
    hkv, d = text.num_key_value_heads, getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    amax = torch.full((hkv, d), 0.1)
    amax[:, 1], amax[:, d // 2 + 1] = 30.0, 12.0
    return {layer: kvquant.key_factors(amax) for layer in range(text.num_hidden_layers)}


@pytest.fixture(scope="module")
def factored_checkpoint(tiny_nosa_checkpoint, tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("factored") / "nosa")
    shutil.copytree(tiny_nosa_checkpoint, path)
    kv_calibrate.save_key_factors(path, key_factors_for(path), {"calibration": "test"})
    return path


@pytest.fixture(scope="module")
def servers(tiny_nosa_checkpoint, factored_checkpoint, tmp_path_factory, nosa_server):
    ckpt = tiny_nosa_checkpoint
    logs = tmp_path_factory.mktemp("logs")
    stats = str(logs / "stats.json")
    own = {
        "on": ServerProcess(ckpt, [*COMMON, "--page-size", str(CFG.block_size)], str(logs / "on.log"),
                            env={**OFFLOAD_ENV, "NOSA_SERVE_STATS_FILE": stats}),
        "bad": ServerProcess(ckpt, [*COMMON, "--page-size", "1"], str(logs / "bad.log"), env=OFFLOAD_ENV),
        "int8": ServerProcess(factored_checkpoint, [*COMMON, "--page-size", str(CFG.block_size)],
                              str(logs / "int8.log"), env={**OFFLOAD_ENV, "NOSA_HOST_KV_DTYPE": "int8"}),
        "fp8": ServerProcess(ckpt, [*COMMON, "--page-size", str(CFG.block_size), "--enable-metrics"],
                             str(logs / "fp8.log"),
                             env={**OFFLOAD_ENV, **SCHED_ENV, "NOSA_HOST_KV_DTYPE": "float8_e4m3fn",
                                  "NOSA_SERVE_STATS_FILE": str(logs / "fp8.json"),
                                  "NOSA_SERVE_WANDB_DIR": str(logs / "wandb")}),
    }
    procs = {**own, "off": nosa_server}
    try:
        for name in ("on", "off", "int8", "fp8"):
            procs[name].wait_ready(timeout=600)  # three servers start at once on a shared 2-core machine
        yield {**procs, "stats": stats, "fp8_stats": str(logs / "fp8.json"), "fp8_wandb": str(logs / "wandb")}
    finally:
        stop_all(own.values())


def _stats(servers, settle: float = 15.0, key: str = "stats") -> dict:
    deadline = time.time() + settle
    while True:
        with open(servers[key]) as f:
            counts = json.load(f)
        if (counts["requests"] == 0 and counts["device_slots_in_use"] == 0) or time.time() > deadline:
            return counts
        time.sleep(0.5)


def test_offload_equals_offload_off(servers):
    for length, seed in LONG:
        prompt = tiny.prompt_ids(length, seed)
        assert servers["on"].generate(prompt, NEW) == servers["off"].generate(prompt, NEW), length


def _mixed_at_once_equal(servers, name: str, seed: int, reference) -> None:
    """8 requests of mixed lengths sent to server ``name`` at once get ``reference(prompt, 8)``'s
    tokens, each asked alone."""
    prompts = [tiny.prompt_ids(n, seed + n) for n in (35, 90, 150, 260, 410, 520, 70, 333)]
    want = [reference(p, 8) for p in prompts]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda p: servers[name].generate(p, 8), prompts))
    assert got == want


def test_concurrent_mixed_lengths_equal_offload_off(servers):
    """8 requests at once; the device budget runs two at a time (SGLang queues the rest)."""
    _mixed_at_once_equal(servers, "on", 100, servers["off"].generate)


def test_context_many_times_the_device_budget_equals_hf(servers, tiny_nosa_checkpoint):
    """A 2100-token prompt is 8.2x the device KV budget (256 tokens): it is admitted, streamed
    through the host pool chunk by chunk, and decodes the HF model's tokens."""
    prompt = tiny.prompt_ids(2100, 77)
    assert len(prompt) >= 8 * DEVICE
    model = nosa.from_pretrained(tiny_nosa_checkpoint)
    assert servers["on"].generate(prompt, 10) == tiny.hf_greedy(model, prompt, 10)


def test_quantized_host_kv_serves_the_hf_reference_with_the_same_roundtrip(servers, tiny_nosa_checkpoint,
                                                                           factored_checkpoint):
    """int8 / fp8 host pools (nosa.kvquant): the replies equal the HF model attending over K and V
    quantized and dequantized the same way while it selects from the exact keys (nosa.hf.host_kv_dtype;
    int8 with the checkpoint's key factors, as the server loads them). The prompts are chunked (128
    tokens), so the exact keys of chunk boundaries are exercised. The other references are told apart
    on these prompts: the HF model in full precision (the pool's dtype changes some replies), and
    int8 without the key factors (a server that ignored them)."""
    from nosa.hf import host_kv_dtype

    model = nosa.from_pretrained(tiny_nosa_checkpoint)
    factors = kv_calibrate.load_key_factors(factored_checkpoint)
    differs, unfactored = 0, 0
    for name, fmt, kf in (("int8", torch.int8, factors), ("fp8", torch.float8_e4m3fn, None)):
        for length, seed in [*LONG, (700, 5)]:
            prompt = tiny.prompt_ids(length, seed)
            with host_kv_dtype(model, fmt, kf):
                want = tiny.hf_greedy(model, prompt, NEW)
            got = servers[name].generate(prompt, NEW)
            assert got == want, (name, length)
            differs += got != tiny.hf_greedy(model, prompt, NEW)
            if kf is not None and not unfactored:  # (one difference is enough)
                with host_kv_dtype(model, fmt):
                    unfactored += got != tiny.hf_greedy(model, prompt, NEW)
    assert differs, "no reply changed with the pool's dtype: the test cannot tell the formats apart"
    assert unfactored, "no int8 reply changed with the key factors: the test cannot tell them apart"


def _scrape(server) -> dict[str, float]:
    """/metrics of a server: each series' value summed over its label sets (histogram parts apart)."""
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{", 1)[0]
            if "decision=" in name_labels:
                name += "{" + name_labels.split("decision=", 1)[1].split('"')[1] + "}"
            out[name] = out.get(name, 0.0) + float(value)
    return out


def test_prometheus_metrics_equal_the_stats_file(servers):
    """With --enable-metrics, /metrics has nosa's series from the scheduler process, equal to the
    counts of $NOSA_SERVE_STATS_FILE once the server is idle; one hit-rate observation per request."""
    for n, seed in ((260, 41), (500, 42)):
        servers["fp8"].generate(tiny.prompt_ids(n, seed), 20)
    counts = _stats(servers, key="fp8_stats")
    assert counts["requests"] == 0
    got = _scrape(servers["fp8"])
    layers = len(counts["offload"]["hits"])
    for series, key in (("nosa:block_cache_hits_total", "hits"), ("nosa:block_cache_misses_total", "misses"),
                        ("nosa:selected_blocks_total", "selected"), ("nosa:recalled_bytes_total", "recalled_bytes"),
                        ("nosa:prefetched_blocks_total", "prefetched"), ("nosa:prefetch_hits_total", "prefetch_hits"),
                        ("nosa:warm_selected_blocks_total", "warm_selected"),
                        ("nosa:warm_block_cache_hits_total", "warm_hits")):
        assert got.get(series, 0.0) == pytest.approx(sum(counts["offload"][key])), series
    assert got["nosa:decode_steps_total"] == pytest.approx(sum(counts["offload"]["steps"]) / layers)
    assert got["nosa:selected_blocks_total"] > 0 and got["nosa:block_cache_hits_total"] > 0
    assert got["nosa:scheduler_demand_blocks_total"] == pytest.approx(sum(counts["scheduler"]["demand_items"]))
    assert got["nosa:device_slots_in_use"] == counts["device_slots_in_use"] == 0
    assert got["nosa:requests"] == 0
    for decision, n in counts["admission"]["decisions"].items():
        if decision in ("admit", "wait", "grant", "revoke") and n:
            assert got[f"nosa:admission_decisions_total{{{decision}}}"] == n
    assert got["nosa:request_hit_rate_count"] >= 2  # at least the two requests above
    assert got["nosa:request_hit_rate_sum"] <= got["nosa:request_hit_rate_count"]
    assert "sglang:num_running_reqs" in got  # SGLang's own series beside them


def test_counters_add_up_and_recall_stays_within_the_locality_bound(servers):
    servers["on"].generate(tiny.prompt_ids(700, 5), 40)
    counts = _stats(servers)
    off = counts["offload"]
    for layer in range(2):
        assert off["hits"][layer] + off["misses"][layer] == off["selected"][layer]
        assert off["recalled_bytes"][layer] == off["misses"][layer] * _item_bytes(torch.float32)
        assert off["steps"][layer] > 40
        # every KV head has A != 0: per warm step at most query_blocks + 1 blocks are recalled
        assert 1 <= off["max_warm_misses"][layer] <= CFG.query_blocks + 1
    hit_rate = sum(off["hits"]) / sum(off["selected"])
    assert hit_rate > 0.5, hit_rate


def _item_bytes(dtype) -> int:
    """Host bytes of one (block, KV head) item of a pool of ``dtype``: K and V (head_dim 32; a
    quantized pool's scales with them) plus cis (float32). float32: 16 x (32 x 4 x 2 + 4)."""
    from nosa import kvquant

    return CFG.block_size * kvquant.bytes_per_token(32, 32, dtype)


def test_no_block_leaks_after_finish_and_abort(servers):
    """Finished and aborted (client gone mid-stream) requests give back their states and device
    slots; SGLang's own idle leak check on the host pool keeps passing (the server stays healthy)."""
    import urllib.request

    def stream_and_drop():
        body = json.dumps({"input_ids": tiny.prompt_ids(500, 9), "stream": True,
                           "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}})
        req = urllib.request.Request(servers["on"].url + "/generate", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            for _ in range(5):
                r.readline()
        # leaving the with-block closes the connection: SGLang aborts the request

    threads = [threading.Thread(target=stream_and_drop) for _ in range(2)]
    for t in threads:
        t.start()
    servers["on"].generate(tiny.prompt_ids(120, 4), 5)
    for t in threads:
        t.join()
    counts = _stats(servers, settle=60)
    assert counts["requests"] == 0 and counts["layer_states"] == 0, counts
    assert counts["device_slots_in_use"] == 0, counts
    prompt = tiny.prompt_ids(300, 11)
    assert servers["on"].generate(prompt, NEW) == servers["off"].generate(prompt, NEW)


def test_request_larger_than_the_host_pool_is_refused_and_others_are_served(servers):
    status, body = servers["on"].post("/generate", {"input_ids": tiny.prompt_ids(HOST + 200, 1),
                                                    "sampling_params": {"max_new_tokens": 2}})
    assert status == 400, (status, body)
    prompt = tiny.prompt_ids(333, 13)
    assert servers["on"].generate(prompt, NEW) == servers["off"].generate(prompt, NEW)


def test_bad_offload_settings_stop_start_up_with_the_setting_named(servers):
    with pytest.raises(RuntimeError) as err:
        servers["bad"].wait_ready(timeout=180)
    assert "--page-size must equal NosaConfig.block_size=16" in str(err.value)


def test_scheduling_and_admission_leave_outputs_unchanged(servers, tiny_nosa_checkpoint):
    """Recall scheduler, prefetch and admission on (the fp8 server): the HF model's tokens over the
    same fp8 round trip, which nothing schedules, one request at a time and 8 at once (the device
    budget runs two; admission may hold more back)."""
    from nosa.hf import host_kv_dtype

    model = nosa.from_pretrained(tiny_nosa_checkpoint)
    for length, seed in LONG:
        prompt = tiny.prompt_ids(length, seed)
        with host_kv_dtype(model, torch.float8_e4m3fn):
            assert servers["fp8"].generate(prompt, NEW) == tiny.hf_greedy(model, prompt, NEW), length
    with host_kv_dtype(model, torch.float8_e4m3fn):
        _mixed_at_once_equal(servers, "fp8", 200, lambda prompt, new: tiny.hf_greedy(model, prompt, new))


def test_scheduled_counters_add_up_and_feed_the_dashboard(servers, tmp_path):
    import os
    import subprocess
    import sys

    servers["fp8"].generate(tiny.prompt_ids(700, 5), 40)
    counts = _stats(servers, key="fp8_stats")
    off, sched = counts["offload"], counts["scheduler"]
    for layer in range(2):
        assert off["hits"][layer] + off["misses"][layer] == off["selected"][layer]
        # what a recall moves from an fp8 pool: 1-byte K and V, their scales, cis
        assert off["recalled_bytes"][layer] == off["misses"][layer] * _item_bytes(torch.float8_e4m3fn)
        # every demand miss went through the worker; every prefetched item it copied was claimed
        assert sched["demand_items"][layer] == off["misses"][layer]
        assert sched["prefetch_items"][layer] == off["prefetched"][layer]
        assert off["prefetch_hits"][layer] <= min(off["hits"][layer], off["prefetched"][layer])
    # layer 1 is prefetched while layer 0 computes: after each prefill its cold cache is filled
    assert off["prefetch_hits"][1] > 0 and off["prefetched"][0] == 0
    assert counts["admission"]["decisions"]["admit"] >= 1
    assert counts["admission"]["bandwidth_bytes_per_s"] > 0
    steps = counts["timeline"]
    assert steps and all(sum(r["layers"]["hits"]) + sum(r["layers"]["misses"]) == sum(r["layers"]["selected"])
                         for r in steps)
    # W&B offline run plus its metrics.jsonl; the dashboard reads both the stats file and the jsonl
    metrics = os.path.join(servers["fp8_wandb"], "metrics.jsonl")
    assert os.path.exists(metrics)
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "serve_dashboard.py")
    for source in (servers["fp8_stats"], metrics):
        png = tmp_path / (os.path.basename(source) + ".png")
        done = subprocess.run([sys.executable, script, source, "--plot", str(png), "--json"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert png.stat().st_size > 10_000
        assert json.loads(done.stdout[: done.stdout.rindex("}") + 1])["steps"] > 0


def test_retracted_requests_give_back_their_blocks_and_finish_with_the_same_tokens(servers):
    """Two requests whose decodes outgrow the 3000-token host pool (admitted on SGLang's estimate
    of 0.7 x max_new_tokens): SGLang retracts one mid-decode and re-runs it later. Both finish with
    offloading-off's tokens, and every state and device slot comes back."""
    servers["on"].post("/flush_cache", {})
    prompts = [tiny.prompt_ids(1000, 61), tiny.prompt_ids(1000, 62)]
    want = [servers["off"].generate(p, 700) for p in prompts]
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda p: servers["on"].generate(p, 700), prompts))
    assert got == want
    assert "retract" in servers["on"].log_tail(200_000).lower(), "no request was retracted: the test did not test that"
    counts = _stats(servers, settle=60)
    assert counts["requests"] == 0 and counts["device_slots_in_use"] == 0, counts
