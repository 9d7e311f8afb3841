"""Decode under SGLang's CPU graph runner (``--enable-torch-compile`` on the CPU engine: the decode
step of each batch size compiled once with torch.compile, dynamic=False, and replayed) with the nosa
backend, offloading off and on: real servers on 127.0.0.1, a tiny NOSA checkpoint with non-zero
eviction heads, one graph, for batches of 3 (batches of 1 and 2 run it padded to 3: padding rows).

- the served tokens equal the HF model's (which the eager servers of test_sglang_backend.py and
  test_offload.py equal), three prompts at once, then two (a padding row), in batches whose
  selection takes one or the other of two context buckets (offloading off; with offloading on, one
  bucket);
- the decode batches ran through the compiled graph (SGLang logs "cpu graph: True") and nothing
  was compiled again after the capture (TORCH_LOGS=recompiles), whichever context bucket a batch's
  selection took;
- with offloading the counters add up and every state and device slot comes back.
"""

from __future__ import annotations

import json
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("sglang")
from nosa.bench import tiny_checkpoint as tiny  # noqa: E402

_MISSING = tiny.cpu_engine_missing()
if _MISSING:
    pytest.skip(_MISSING, allow_module_level=True)

import nosa  # noqa: E402
from nosa.bench.server.process import ServerProcess, stop_all  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = nosa.NosaConfig.tiny(dense_len=64)  # budget 8 blocks x 16 tokens = 128 tokens
COMMON = ["--skip-server-warmup", "--sleep-on-idle", "--dtype", "float32", "--mem-fraction-static", "0.3",
          "--context-length", "1024", "--attention-backend", "nosa", "--enable-torch-compile",
          "--cuda-graph-bs-decode", "3", "--decode-log-interval", "1", "--max-running-requests", "3"]
OFFLOAD_ENV = {"NOSA_OFFLOAD": "1", "NOSA_HOST_KV_TOKENS": "4096", "NOSA_DEVICE_KV_TOKENS": "384"}
PROMPTS = [(300, 11), (700, 12), (40, 3)]  # two past the budget, one dense (40 <= dense_len 64)
NEW = 12


def _server_env(extra: dict, buckets: int) -> dict:
    """The server's environment: the stand-in of this checkout first on the path (its operator
    declarations let the CPU graph runner start), recompilations logged, inductor compiling in the
    scheduler itself (its pool of compile workers is one more process importing torch, and buys
    nothing while the two servers already keep both cores busy), ``buckets`` context buckets for the
    selection. ``graph`` has two (512 and 1,024 tokens: the batches holding the 700-token prompt take
    the second, the others the first); ``offload`` one: its selection is the same code (what
    offloading changes is where the selected blocks come from), and each bucket is compiled at
    start-up, so each one more adds a minute of CPU here."""
    import sgl_kernel

    env = {"TORCH_LOGS": "recompiles", "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_COMPILE_THREADS": "1",
           "NOSA_GRAPH_SPAN_BUCKETS": str(buckets), **extra}
    if getattr(sgl_kernel, "IS_NOSA_STANDIN", False):
        standin = os.path.join(ROOT, "serve", "tools", "sgl_kernel_standin")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (standin, os.environ.get("PYTHONPATH")) if p)
    return env


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny.make_checkpoint(str(tmp_path_factory.mktemp("ckpt") / "nosa"), CFG, seed=0, evict_scale=1.0)


@pytest.fixture(scope="module")
def servers(ckpt, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    stats = str(logs / "stats.json")
    procs = {
        "graph": ServerProcess(ckpt, [*COMMON, "--max-total-tokens", "4096"], str(logs / "graph.log"),
                               env=_server_env({}, buckets=2)),
        "offload": ServerProcess(ckpt, [*COMMON, "--page-size", str(CFG.block_size)], str(logs / "offload.log"),
                                 env=_server_env({**OFFLOAD_ENV, "NOSA_SERVE_STATS_FILE": stats}, buckets=1)),
    }
    try:
        for proc in procs.values():
            proc.wait_ready(timeout=1200)  # compiling the decode graphs takes minutes on 2 cores
        yield {**procs, "stats": stats}
    finally:
        stop_all(procs.values())


@pytest.fixture(scope="module")
def want(ckpt):
    model = nosa.from_pretrained(ckpt)
    return [tiny.hf_greedy(model, tiny.prompt_ids(n, seed), NEW) for n, seed in PROMPTS]


def _at_once(server, prompts) -> list[list[int]]:
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: server.generate(p, NEW), prompts))


def _graph_log(server) -> tuple[int, list[str]]:
    """(decode batches run through the graph, recompilations after the capture) from the log.

    After the *last* capture: a server that lost its port to another process is started again
    (``ServerProcess``), appending a second start-up, with its own capture, to the same log."""
    with open(server.log_path, errors="replace") as f:
        text = f.read()
    marker = "Capture target decode CPU graph end"
    assert marker in text, server.log_tail()
    after = text.rsplit(marker, 1)[-1]
    return len(re.findall(r"cpu graph: True", after)), re.findall(r"Recompiling function .*", after)


@pytest.mark.parametrize("name", ["graph", "offload"])
def test_compiled_decode_gives_the_hf_tokens(servers, want, name):
    prompts = [tiny.prompt_ids(n, seed) for n, seed in PROMPTS]
    assert _at_once(servers[name], prompts) == want  # batches of 3 (then 2 and 1 as requests finish)
    assert _at_once(servers[name], prompts[:2]) == want[:2]  # 2 requests: one padding row
    assert _at_once(servers[name], [prompts[0], prompts[2]]) == [want[0], want[2]]  # the 512-token bucket
    graphed, recompiled = _graph_log(servers[name])
    assert graphed >= NEW and recompiled == []


def test_offload_counters_add_up_and_everything_comes_back(servers, want):
    servers["offload"].generate(tiny.prompt_ids(*PROMPTS[0]), NEW)
    deadline = time.time() + 15
    while True:
        with open(servers["stats"]) as f:
            counts = json.load(f)
        if (counts["requests"] == 0 and counts["device_slots_in_use"] == 0) or time.time() > deadline:
            break
        time.sleep(0.5)
    assert counts["requests"] == 0 and counts["layer_states"] == 0 and counts["device_slots_in_use"] == 0
    off = counts["offload"]
    for layer in range(2):
        assert off["hits"][layer] + off["misses"][layer] == off["selected"][layer] > 0
        assert off["max_warm_misses"][layer] <= CFG.query_blocks + 1
