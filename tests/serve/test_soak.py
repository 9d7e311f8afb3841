"""scripts/soak.py --quick in CI: about 1 minute of mixed load and malformed requests on a real
server with the nosa backend; the script asserts and reports, this test reads its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("sglang")
from nosa.bench import tiny_checkpoint as tiny  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_quick_soak(tmp_path):
    missing = tiny.cpu_engine_missing()
    if missing:
        pytest.skip(missing)
    out = tmp_path / "soak.json"
    run = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "soak.py"), "--quick", "--out", str(out)],
                         capture_output=True, text=True, timeout=900)
    assert out.exists(), run.stderr[-3000:]
    report = json.loads(out.read_text())
    assert run.returncode == 0 and report["passed"], (report["failures"], report.get("server_log_tail"))
    # What the script checked, so a silently skipped phase fails here.
    assert report["requests_total"] >= 8 and report["requests"].get("generate", {}).get("200", 0) >= 1
    assert set(report["requests"]) == {"generate", "stream", "disconnect", "abort", "prefix", "completions", "chat",
                                       "malformed"}  # every kind of request was sent under load
    assert report["probes_identical"]
    assert report["burst"] == {**report["burst"], "requests": 100, "ok": 100}
    for listed in (report["malformed_first"], report["malformed_last"]):
        assert len(listed) >= 20 and set(listed.values()) <= {200, 400}
        assert listed["batch with an empty row"] == 400 and listed["id = vocab_size"] == 400
    stats = report["idle_stats"]
    assert stats["requests"] == 0 and stats["layer_states"] == 0 and stats["freed_total"] > 100
    assert all(v == 0 for k, v in stats.items() if k.endswith("_in_use"))
