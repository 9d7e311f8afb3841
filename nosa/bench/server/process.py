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

    # The port is free when chosen, but SGLang binds it only at the end of its start-up (a minute on a
    # busy machine), while the other servers starting meanwhile take ports of their own: a start that
    # lost its port that way is retried on another one, up to this many times.
    PORT_RETRIES = 3

    def __init__(self, model_path: str, args: list[str], log_path: str, env: dict | None = None,
                 device: str = "cpu"):
        self.model_path = model_path
        self.log_path = log_path
        self._args, self._device = args, device
        self._env = dict(os.environ, **(env or {}))
        if device == "cpu":
            self._env["SGLANG_USE_CPU_ENGINE"] = "1"
        self._log = open(log_path, "w")
        self._retries = self.PORT_RETRIES
        self._start()

    def _start(self) -> None:
        """Launch the server on a port free now; its output goes to the log (appended on a retry)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log_start = self._log.tell()
        self.proc = subprocess.Popen(self._command(), stdout=self._log, stderr=subprocess.STDOUT, env=self._env,
                                     start_new_session=True)

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "sglang.launch_server", "--model-path", self.model_path,
                "--host", "127.0.0.1", "--port", str(self.port), "--device", self._device, *self._args]

    def _lost_its_port(self) -> bool:
        """Whether the server, which has exited, failed to bind its HTTP port."""
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            f.seek(self._log_start)
            return f"('127.0.0.1', {self.port}): address already in use" in f.read()

    def wait_ready(self, timeout: float = 240.0) -> "ServerProcess":
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                if self._retries > 0 and self._lost_its_port():
                    self._retries -= 1
                    self._log.write(f"\n[nosa.bench] port {self.port} was taken meanwhile: starting again\n")
                    self._log.flush()
                    self._start()
                    continue
                raise RuntimeError(f"SGLang server exited with {self.proc.returncode}: {self.why_it_exited()}\n"
                                   f"{self.log_tail()}")
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

    def why_it_exited(self) -> str:
        """The last Python error in the log (a scheduler's traceback ends with it), or a line saying
        that a process died without one (killed by the OS, e.g. for memory)."""
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            f.seek(self._log_start)
            lines = f.read().splitlines()
        for i in range(len(lines) - 1, -1, -1):
            if lines[i].startswith("Traceback (most recent call last)"):
                errors = [line for line in lines[i + 1:] if line and not line.startswith((" ", "["))]
                if errors:
                    return errors[0]
        if any("Received sigquit from a child process" in line for line in lines):
            return ("a server process died without a Python error (killed by a signal: out of memory? "
                    "see the kernel log)")
        return "no Python error in the log"

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
