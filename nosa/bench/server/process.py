"""Start and stop a local SGLang server in a subprocess (used by tests/serve and scripts/).

``SGLANG_USE_CPU_ENGINE`` is read by SGLang at import time, so it is set in the child's
environment here, never by the plugin.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from nosa.net import free_port


def cpu_binding(ranks: int) -> str:
    """SGLANG_CPU_OMP_THREADS_BIND for ``ranks`` CPU ranks (TP x DP): the usable cores split into
    contiguous ranges, one per rank ("0|1" on 2 cores; ranks share a core when there are fewer
    cores). SGLang requires it when ranks outnumber NUMA nodes; its threads are pinned to the
    ranges only by the Intel CPU build of sgl-kernel."""
    cores = sorted(os.sched_getaffinity(0))
    share = max(1, len(cores) // ranks)
    ranges = []
    for rank in range(ranks):
        first = (rank * share) % len(cores)
        ranges.append(str(cores[first]) if share == 1 else f"{cores[first]}-{cores[first + share - 1]}")
    return "|".join(ranges)


class ServerProcess:
    """``python -m sglang.launch_server`` on 127.0.0.1; ``start()`` returns once /health answers."""

    def __init__(self, model_path: str, args: list[str], log_path: str, env: dict | None = None,
                 device: str = "cpu"):
        self.model_path = model_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path,
               "--host", "127.0.0.1", "--port", str(self.port), "--device", device, *args]
        child_env = dict(os.environ, **(env or {}))
        if device == "cpu":
            child_env["SGLANG_USE_CPU_ENGINE"] = "1"
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=child_env,
                                     start_new_session=True)

    def wait_ready(self, timeout: float = 240.0) -> "ServerProcess":
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SGLang server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)
        tail = self.log_tail()  # before stop(), which closes the log
        self.stop()
        raise RuntimeError(f"SGLang server not healthy after {timeout:.0f} s:\n{tail}")

    def log_tail(self, chars: int = 4000) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()[-chars:]

    def post(self, path: str, payload: dict, timeout: float = 300.0) -> tuple[int, dict | str]:
        """(HTTP status, decoded JSON body or text)."""
        req = urllib.request.Request(self.url + path, data=json.dumps(payload).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                status, body = r.status, r.read().decode()
        except urllib.error.HTTPError as err:
            status, body = err.code, err.read().decode()
        try:
            return status, json.loads(body)
        except json.JSONDecodeError:
            return status, body

    def generate(self, input_ids: list[int], max_new_tokens: int, **extra) -> list[int]:
        """Greedy completion ids (EOS ignored)."""
        params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
        status, body = self.post("/generate", {"input_ids": input_ids, "sampling_params": params, **extra})
        if status != 200:
            raise RuntimeError(f"/generate returned {status}: {body}")
        return body["output_ids"]

    def pause(self) -> None:
        """Stop the server and its children (SIGSTOP to its process group): an idle SGLang server
        keeps a core busy polling, so a benchmark that keeps several up pauses all but one."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Undo ``pause`` (SIGCONT)."""
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        """Ask the server and the children it spawned to exit (SIGTERM, then SIGCONT so that a paused
        server acts on it); ``stop()`` waits for them."""
        self._signal(signal.SIGTERM)
        self._signal(signal.SIGCONT)

    def stop(self, timeout: float = 30.0) -> None:
        """Terminate, wait up to ``timeout`` seconds for the exit, then kill what is left."""
        self.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait()
        self._log.close()


def stop_all(servers) -> None:
    """Stop several servers at once. SGLang's launcher looks for SIGTERM only every 5 s, so each
    exit takes seconds of waiting: signalling them all first overlaps those waits."""
    servers = list(servers)
    for server in servers:
        server.terminate()
    for server in servers:
        server.stop()
