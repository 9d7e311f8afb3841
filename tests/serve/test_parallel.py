"""Tensor- and data-parallel serving on CPU: real SGLang servers with two scheduler processes each.

Servers, started together (SGLANG_CPU_OMP_THREADS_BIND, one share of the cores per rank: SGLang
asks for it when ranks outnumber NUMA nodes), on tiny NOSA checkpoints with non-zero eviction heads on every KV head:
- ``tp_offload``: GQA 4/2, ``--tp-size 2`` (one KV head per rank: the eviction heads all-reduce),
  offloading on (host pool and device slots per rank). TP with offloading off is not started here:
  its selection (and all-reduce) is the offloading path's, and its device-resident KV is TP 1's
  (test_sglang_backend.py), so a fifth and sixth scheduler would buy the suite a minute, no coverage;
- ``mqa_offload``: one KV head, ``--tp-size 2`` (more ranks than KV heads: SGLang's CPU path pads a
  zero head onto rank 1, a GPU replicates the head), offloading on;
- ``dp``: GQA 4/2, ``--dp-size 2`` (two replicas behind one endpoint), offloading on.
The reference is the HF model from ``nosa.from_pretrained``, whose greedy tokens a TP 1 server
reproduces for the same checkpoint and prompts (tests/serve/test_sglang_backend.py,
test_offload.py). Each rank or replica writes its own stats file (nosa.serve.parallel.rank_path).
"""

from __future__ import annotations

import json
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
from nosa.bench.server.process import ServerProcess, cpu_binding, stop_all  # noqa: E402

CFG = nosa.NosaConfig.tiny(dense_len=64)  # budget 8 blocks x 16 tokens = 128 tokens per request
COMMON = ["--skip-server-warmup", "--sleep-on-idle", "--dtype", "float32", "--mem-fraction-static", "0.3",
          "--context-length", "1024", "--attention-backend", "nosa", "--chunked-prefill-size", "128"]
OFFLOAD = ["--page-size", str(CFG.block_size)]
BIND = {"SGLANG_CPU_OMP_THREADS_BIND": cpu_binding(2)}
OFFLOAD_ENV = {"NOSA_OFFLOAD": "1", "NOSA_HOST_KV_TOKENS": "3000", "NOSA_DEVICE_KV_TOKENS": "256"}
LONG = [(300, 11), (457, 12), (40, 3)]  # (prompt length, seed); 40 <= dense_len attends densely
MIXED = [35, 90, 150, 260, 410, 520, 70, 333]  # prompt lengths sent at once
NEW = 10


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {"gqa": tiny.make_checkpoint(str(root / "gqa"), CFG, seed=0, evict_scale=1.0),
            "mqa": tiny.make_checkpoint(str(root / "mqa"), CFG, seed=3, evict_scale=1.0, kv_heads=1)}


@pytest.fixture(scope="module")
def servers(ckpts, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    specs = {
        "tp_offload": (ckpts["gqa"], ["--tp-size", "2", *OFFLOAD], OFFLOAD_ENV),
        "mqa_offload": (ckpts["mqa"], ["--tp-size", "2", *OFFLOAD], OFFLOAD_ENV),
        "dp": (ckpts["gqa"], ["--dp-size", "2", *OFFLOAD], OFFLOAD_ENV),
    }
    procs = {}
    try:
        for name, (ckpt, args, env) in specs.items():
            stats = str(logs / f"{name}.json")
            procs[name] = ServerProcess(ckpt, [*COMMON, *args], str(logs / f"{name}.log"),
                                        env={**BIND, **env, "NOSA_SERVE_STATS_FILE": stats})
            procs[name].stats_path = stats
        for proc in procs.values():
            proc.wait_ready(timeout=600)  # six scheduler processes start at once on a shared 2-core machine
        yield procs
    finally:
        stop_all(procs.values())


@pytest.fixture(scope="module")
def want(ckpts):
    """The HF model's greedy tokens: LONG prompts per checkpoint, and the MIXED prompts (GQA)."""
    models = {name: nosa.from_pretrained(path) for name, path in ckpts.items()}
    out = {name: [tiny.hf_greedy(model, tiny.prompt_ids(n, s), NEW) for n, s in LONG] for name, model in models.items()}
    out["mixed"] = [tiny.hf_greedy(models["gqa"], tiny.prompt_ids(n, 100 + n), NEW) for n in MIXED]
    return out


def _stats(path: str, settle: float = 30.0) -> dict:
    """One rank's counters once its requests and device slots are back to zero (or ``settle`` ran out)."""
    deadline = time.time() + settle
    while True:
        with open(path) as f:
            counts = json.load(f)
        if (counts["requests"] == 0 and counts.get("device_slots_in_use", 0) == 0) or time.time() > deadline:
            return counts
        time.sleep(0.5)


def _rank_file(server, suffix: str) -> str:
    return server.stats_path.replace(".json", f".{suffix}.json")


def _at_once(server) -> list[list[int]]:
    prompts = [tiny.prompt_ids(n, 100 + n) for n in MIXED]
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: server.generate(p, NEW), prompts))


@pytest.mark.parametrize("name,ckpt", [("tp_offload", "gqa"), ("mqa_offload", "mqa")])
def test_tensor_parallel_equals_tp1(servers, want, name, ckpt):
    got = [servers[name].generate(tiny.prompt_ids(n, s), NEW) for n, s in LONG]
    assert got == want[ckpt]


def test_kv_heads_and_host_pools_are_per_rank(servers):
    """Each rank logs the KV heads it holds and sizes its host pool for them alone."""
    gqa, mqa = servers["tp_offload"].log_tail(1_000_000), servers["mqa_offload"].log_tail(1_000_000)
    for rank in (0, 1):
        assert re.search(rf"TP{rank}\] nosa backend: TP rank {rank} of 2 holds KV heads \[{rank}\] of 2 \(2 real\); "
                         "eviction heads all-reduce partial sums", gqa)
        assert re.search(rf"TP{rank}\] nosa offloading: host pool \d+ tokens x 1 KV heads", gqa)
        # SGLang's CPU path pads the single KV head to one per rank: rank 1 holds the zero padding head
        assert re.search(rf"TP{rank}\] nosa backend: TP rank {rank} of 2 holds KV heads \[{rank}\] of 2 \(1 real\); "
                         "eviction heads need no other rank", mqa)


def _idle_stats(server, ranks) -> list[dict]:
    """The stats file of each of ``ranks`` ("tp0", "dp1"), checked to hold no request state and no
    device slot."""
    stats = [_stats(_rank_file(server, rank)) for rank in ranks]
    for counts in stats:
        assert counts["requests"] == 0 and counts["layer_states"] == 0, counts
        assert counts["device_slots_in_use"] == 0, counts
    return stats


def test_tensor_parallel_concurrent_requests_free_every_rank(servers, want):
    server = servers["tp_offload"]
    assert _at_once(server) == want["mixed"]
    ranks = _idle_stats(server, ("tp0", "tp1"))
    # both ranks ran every request, step for step
    assert ranks[0]["freed_total"] == ranks[1]["freed_total"] >= len(MIXED)
    assert ranks[0]["offload"]["steps"] == ranks[1]["offload"]["steps"]


def test_data_parallel_concurrent_requests_equal_one_replica(servers, want):
    server = servers["dp"]
    assert _at_once(server) == want["mixed"]
    replicas = _idle_stats(server, ("dp0", "dp1"))
    for counts in replicas:
        assert counts["freed_total"] >= 1, "each replica served requests"
    assert sum(c["freed_total"] for c in replicas) >= len(MIXED)
