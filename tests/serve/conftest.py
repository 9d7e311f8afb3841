"""SGLang servers that several test modules compare against, started once per session.

Starting a server costs about 30 CPU-seconds (three Python processes importing SGLang and torch),
which on a 2-core machine is most of the suite's time; an idle one (--sleep-on-idle) costs nothing.
Both serve the tiny NOSA checkpoint (random non-zero eviction heads, NosaConfig.tiny(dense_len=64)):
- ``nosa_server``: --attention-backend nosa, offloading off (the KV in SGLang's pool), chunked
  prefill of 128 tokens, radix cache on, context length ``context_length`` (4096), decode-state
  counters in the file ``stats_path`` ($NOSA_SERVE_STATS_FILE);
- ``native_server``: SGLang's own --attention-backend torch_native, radix cache off (SGLang asks for
  that with input_embeds, which tests/serve/test_validation.py sends).
The fixtures return a started server; a module that starts its own servers too calls
``wait_ready()`` on all of them after starting them, so that the start-ups overlap.
"""

from __future__ import annotations

import pytest

NOSA_CONTEXT = 4096


@pytest.fixture(scope="session")
def tiny_nosa_checkpoint(tmp_path_factory) -> str:
    """The tiny NOSA checkpoint served by the shared servers (tiny_checkpoint.make_checkpoint, seed 0)."""
    pytest.importorskip("sglang")
    import nosa
    from nosa.bench import tiny_checkpoint as tiny

    path = str(tmp_path_factory.mktemp("shared_ckpt") / "nosa")
    return tiny.make_checkpoint(path, nosa.NosaConfig.tiny(dense_len=64), seed=0, evict_scale=1.0)


def _common(context: int) -> list[str]:
    return ["--skip-server-warmup", "--sleep-on-idle", "--dtype", "float32", "--max-total-tokens", "8192",
            "--mem-fraction-static", "0.3", "--context-length", str(context)]


@pytest.fixture(scope="session")
def shared_servers():
    """The session's shared servers, by name, as started; stopped together at the end of the session
    (each exit waits for SGLang's SIGTERM check, see nosa.bench.server.process.stop_all)."""
    from nosa.bench import tiny_checkpoint as tiny
    from nosa.bench.server.process import stop_all

    if tiny.cpu_engine_missing():
        pytest.skip(tiny.cpu_engine_missing())
    started = {}
    try:
        yield started
    finally:
        stop_all(started.values())


@pytest.fixture(scope="session")
def nosa_server(shared_servers, tiny_nosa_checkpoint, tmp_path_factory):
    from nosa.bench.server.process import ServerProcess

    logs = tmp_path_factory.mktemp("nosa_server")
    stats = str(logs / "stats.json")
    server = ServerProcess(tiny_nosa_checkpoint, ["--attention-backend", "nosa", "--chunked-prefill-size", "128",
                                                  *_common(NOSA_CONTEXT)], str(logs / "server.log"),
                           env={"NOSA_SERVE_STATS_FILE": stats})
    server.stats_path, server.context_length = stats, NOSA_CONTEXT
    shared_servers["nosa"] = server
    return server


@pytest.fixture(scope="session")
def native_server(shared_servers, tiny_nosa_checkpoint, tmp_path_factory):
    from nosa.bench.server.process import ServerProcess

    log = str(tmp_path_factory.mktemp("native_server") / "server.log")
    server = ServerProcess(tiny_nosa_checkpoint, ["--attention-backend", "torch_native", "--disable-radix-cache",
                                                  *_common(1024)], log)
    shared_servers["native"] = server
    return server
