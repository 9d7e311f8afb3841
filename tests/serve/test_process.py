"""nosa.bench.server.process.ServerProcess on stand-in processes (no SGLang): pause stops every process
of the group, resume continues them, a paused server still stops; a start that lost its port to another
process starts again on another port, and no other failure is retried."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import pytest

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


# A stand-in for SGLang's launcher: binds --port late and answers /health; when the port is taken it
# fails the way uvicorn does (the message ServerProcess looks for) and exits 3.
STANDIN = """
import http.server, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
try:
    server = http.server.HTTPServer(("127.0.0.1", port), Health)
except OSError:
    print(f"ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
          "address already in use", flush=True)
    sys.exit(3)
server.serve_forever()
"""


class StandInServer(ServerProcess):
    def _command(self) -> list[str]:
        return [sys.executable, "-c", STANDIN, "--port", str(self.port)]


def test_a_start_that_lost_its_port_starts_again_on_another(tmp_path, monkeypatch):
    import socket
    import urllib.request

    from nosa.bench.server import process
    from nosa.net import free_port

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()  # another process holds this port when the server gets to bind it
    ports = iter([taken.getsockname()[1]])
    monkeypatch.setattr(process, "free_port", lambda: next(ports, None) or free_port())
    server = StandInServer("ckpt", [], str(tmp_path / "server.log"))
    try:
        assert server.port == taken.getsockname()[1]
        server.wait_ready(timeout=60)
        assert server.port != taken.getsockname()[1]
        with urllib.request.urlopen(server.url + "/health", timeout=5) as r:
            assert r.status == 200
        log = (tmp_path / "server.log").read_text()
        assert "address already in use" in log and "starting again" in log
    finally:
        server.stop(timeout=10)
        taken.close()


def test_a_server_that_fails_otherwise_is_not_started_again(tmp_path, monkeypatch):
    class Failing(ServerProcess):
        def _command(self) -> list[str]:
            return [sys.executable, "-c", "import sys; print('ValueError: malformed nosa section'); sys.exit(1)"]

    server = Failing("ckpt", [], str(tmp_path / "server.log"))
    try:
        with pytest.raises(RuntimeError, match="(?s)exited with 1:.*malformed nosa section"):
            server.wait_ready(timeout=30)
        assert "starting again" not in (tmp_path / "server.log").read_text()
    finally:
        server.stop(timeout=10)


@pytest.mark.parametrize("output, why", [
    # a scheduler's traceback, then the launcher's lines (more than the log tail holds)
    ("Traceback (most recent call last):\n  File \"x.py\", line 1, in f\n    raise ValueError\n"
     "ValueError: nosa backend: needs --disable-radix-cache\n\n" + "[t] Received sigquit from a child process.\n" * 300,
     "exited with -9: ValueError: nosa backend: needs --disable-radix-cache"),
    ("[t] Ignore import error\n[t] Received sigquit from a child process. It usually means the child failed.\n",
     "exited with -9: a server process died without a Python error"),
])
def test_a_failed_start_names_the_error_first(tmp_path, output, why):
    class Failing(ServerProcess):
        def _command(self) -> list[str]:
            return [sys.executable, "-c", f"import os, sys; sys.stdout.write({output!r}); sys.stdout.flush(); "
                                          "os.kill(os.getpid(), 9)"]

    server = Failing("ckpt", [], str(tmp_path / "server.log"))
    try:
        with pytest.raises(RuntimeError) as err:
            server.wait_ready(timeout=30)
        assert str(err.value).startswith(f"SGLang server {why}")
    finally:
        server.stop(timeout=10)
