"""scripts/gpu_results.py joins what scripts/gpu_check.sh wrote on the lent GPU into one results file:
a later run replaces only the steps it ran, every part keeps its provenance, the FlashInfer steps
(build, benchmark, tests) are joined, and the notes of earlier joins are kept apart, not nested."""

from __future__ import annotations

import io
import json
import runpy
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MACHINE = {"cpu": "x", "cores": 16, "memory_gib": 125.8, "gpu": "NVIDIA H200", "torch": "2.11.0+cu130",
           "python": "3.12.3"}


def _provenance(command: str) -> dict:
    return {"command": command, "commit": "0" * 40, "dirty": False, "machine": MACHINE, "date": "2026-12-04"}


def _junit(passed: int, failed: int) -> str:
    cases = "".join(f'<testcase classname="tests.t" name="ok{i}"/>' for i in range(passed))
    cases += "".join(f'<testcase classname="tests.t" name="bad{i}"><failure/></testcase>' for i in range(failed))
    return f'<testsuites><testsuite tests="{passed + failed}" skipped="0">{cases}</testsuite></testsuites>'


def _run_folder(folder: Path, steps: dict, files: dict, logs: dict) -> Path:
    folder.mkdir()
    (folder / "summary.json").write_text(json.dumps({"steps": steps}))
    for name, data in files.items():
        (folder / name).write_text(json.dumps(data))
    with tarfile.open(folder / "logs.tar.gz", "w:gz") as tar:
        for name, text in logs.items():
            raw = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(raw)
            tar.addfile(info, io.BytesIO(raw))
    return folder


def _join(monkeypatch, *args: str) -> None:
    script = str(ROOT / "scripts" / "gpu_results.py")
    monkeypatch.setattr(sys, "argv", [script, *args])
    runpy.run_path(script, run_name="__main__")


def test_a_later_run_joins_its_steps_and_keeps_the_earlier_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # write_result records the repository's commit
    ok = {"rc": 0, "seconds": 5}
    first = _run_folder(tmp_path / "run1", {"tests": ok, "bench_recall": ok},
                        {"recall_gpu.json": {"provenance": _provenance("bench_recall"), "link_gbps": 50.0}},
                        {"gpu_tests.xml": _junit(3, 1), "tests.log": "3 passed, 1 failed in 12.5s"})
    base = tmp_path / "gpu.json"
    _join(monkeypatch, str(first), "--out", str(base), "--note", "run 1 note.")
    joined = json.loads(base.read_text())
    assert joined["tests"] == {"passed": 3, "failed": 1, "skipped": 0, "failures": ["tests.t::bad0"],
                               "seconds": 12.5}
    assert "run 1 note." in joined["provenance"]["note"] and "earlier_notes" not in joined

    second = _run_folder(tmp_path / "run2", {"bench_recall": ok, "flashinfer_tests": ok},
                         {"recall_gpu.json": {"provenance": _provenance("bench_recall again"), "link_gbps": 55.0},
                          "flashinfer_build.json": {"provenance": _provenance("build"), "ok": True, "seconds": 24.0},
                          "kernels_flashinfer.json": {"provenance": _provenance("bench_flashinfer"),
                                                      "decode_slots": [{"context": 32768, "faster": "triton"}]}},
                         {"gpu_tests_flashinfer.xml": _junit(2, 0)})
    out = tmp_path / "gpu2.json"
    _join(monkeypatch, str(second), "--out", str(out), "--base", str(base), "--note", "run 2 note.")
    data = json.loads(out.read_text())
    assert data["bench_recall"]["link_gbps"] == 55.0  # the later run's step replaces the earlier one's
    assert data["tests"]["passed"] == 3  # a step the later run did not run stays
    assert data["flashinfer_build"]["ok"] and data["bench_flashinfer"]["decode_slots"][0]["faster"] == "triton"
    assert data["flashinfer_tests"]["passed"] == 2
    steps = {part["step"]: part["command"] for part in data["parts"]}
    assert steps == {"bench_recall": "bench_recall again", "flashinfer_build": "build",
                     "bench_flashinfer": "bench_flashinfer"}
    # the earlier join's note is kept beside the new one, not nested inside it
    assert data["earlier_notes"] == [joined["provenance"]["note"]]
    assert "run 2 note." in data["provenance"]["note"] and "run 1 note." not in data["provenance"]["note"]
    assert [run["folder"] for run in data["runs"]] == ["run1", "run2"]


def test_before_keeps_the_earlier_measurement_of_a_step(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    ok = {"rc": 0, "seconds": 5}
    runs = [_run_folder(tmp_path / f"run{i}", {"train_speed": ok},
                        {"train_gpu.json": {"provenance": _provenance(f"bench_train {i}"), "ratio": ratio}}, {})
            for i, ratio in ((1, 67.0), (2, 3.4))]
    out = tmp_path / "gpu.json"
    _join(monkeypatch, *map(str, runs), "--out", str(out), "--before", "train_speed")
    data = json.loads(out.read_text())
    assert data["train_speed"]["ratio"] == 3.4 and data["train_speed_before"]["ratio"] == 67.0
    steps = {part["step"]: part["command"] for part in data["parts"]}
    assert steps == {"train_speed": "bench_train 2", "train_speed_before": "bench_train 1"}
    _join(monkeypatch, *map(str, runs), "--out", str(out))  # without --before, the later one alone
    assert "train_speed_before" not in json.loads(out.read_text())
