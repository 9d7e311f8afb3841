"""nosa.bench.server.process.ServerProcess's signals on a stand-in process group (no SGLang): pause
stops every process of the group, resume continues them, and a paused server still stops."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

from nosa.bench.server.process import ServerProcess


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]  # R, S, T (stopped), Z ...


def _wait_state(pids, want: str, timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all((_state(p) == "T") == (want == "T") for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_pause_resume_and_stop_a_paused_server():
    server = object.__new__(ServerProcess)  # a launcher with one child, as SGLang's has several
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
           "time.sleep(60)"
    server._log = tempfile.TemporaryFile()
    server.proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.time() + 10
        children = []
        while not children and time.time() < deadline:
            out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(server.proc.pid)], capture_output=True, text=True)
            children = [int(p) for p in out.stdout.split()]
            time.sleep(0.05)
        group = [server.proc.pid, *children]
        assert len(group) == 2
        server.pause()
        assert _wait_state(group, "T")
        server.resume()
        assert _wait_state(group, "S")
        server.pause()
        assert _wait_state(group, "T")
        start = time.time()
        server.stop(timeout=10)  # SIGTERM reaches a stopped process only once it continues
        assert server.proc.returncode is not None and time.time() - start < 10
    finally:
        if server.proc.poll() is None:
            os.killpg(server.proc.pid, 9)
