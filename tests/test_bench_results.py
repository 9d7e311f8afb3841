"""nosa.bench.results.write_result, the one writer of benchmark results: the provenance block (command,
commit, dirty flag, machine, date), the atomic write, and null commit and dirty flag without git."""

import datetime
import json
import os
import platform
import re
import shutil
import subprocess

import pytest
import torch

from nosa.bench import REPO, results
from nosa.bench.results import git_state, write_result


def test_the_result_carries_its_provenance_first(tmp_path):
    path = tmp_path / "deeper" / "r.json"  # the folders are made
    assert write_result(str(path), {"rows": [1, 2]}, argv=["scripts/bench_x.py", "--quick"]) == str(path)
    result = json.loads(path.read_text())
    assert list(result) == ["provenance", "rows"] and result["rows"] == [1, 2]
    prov = result["provenance"]
    assert set(prov) == {"command", "commit", "dirty", "machine", "date"}
    assert prov["command"] == "python scripts/bench_x.py --quick"
    assert prov["date"] == datetime.date.today().isoformat()
    if prov["commit"] is not None:  # a git checkout (null where git or the repository is missing)
        assert re.fullmatch(r"[0-9a-f]{40}", prov["commit"]) and isinstance(prov["dirty"], bool)
    machine = prov["machine"]
    assert set(machine) == {"cpu", "cores", "memory_gib", "gpu", "torch", "python"}
    assert isinstance(machine["cpu"], str) and machine["cpu"]
    assert isinstance(machine["cores"], int) and machine["cores"] >= 1
    assert isinstance(machine["memory_gib"], float) and machine["memory_gib"] > 0
    assert machine["gpu"] == (torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    assert (machine["torch"], machine["python"]) == (torch.__version__, platform.python_version())


def test_the_command_is_as_typed_with_the_script_relative_to_the_checkout(tmp_path):
    path = tmp_path / "r.json"
    write_result(str(path), {}, argv=[os.path.join(REPO, "scripts", "soak.py"), "--env", "A=a b"])
    assert json.loads(path.read_text())["provenance"]["command"] == "python scripts/soak.py --env 'A=a b'"


def test_a_provenance_in_the_data_is_replaced_by_this_runs(tmp_path):
    path = tmp_path / "merged.json"
    write_result(str(path), {"provenance": {"command": "an earlier run"}, "x": 1}, argv=["scripts/m.py"])
    result = json.loads(path.read_text())
    assert result["provenance"]["command"] == "python scripts/m.py" and result["x"] == 1


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "r.json"
    write_result(str(path), {"x": 1}, argv=["scripts/x.py"])
    before = path.read_text()
    with pytest.raises(TypeError):
        write_result(str(path), {"x": object()}, argv=["scripts/x.py"])  # not JSON: fails mid-write
    assert path.read_text() == before
    assert os.listdir(tmp_path) == ["r.json"]


def test_without_git_commit_and_dirty_are_null(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no git executable to be found
    monkeypatch.setattr(results, "STARTED", (None, None))  # nor when the run began
    assert git_state() == (None, None)
    path = tmp_path / "r.json"
    write_result(str(path), {}, argv=["scripts/x.py"])
    prov = json.loads(path.read_text())["provenance"]
    assert (prov["commit"], prov["dirty"]) == (None, None)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_commit_is_the_one_the_run_started_from(tmp_path, monkeypatch):
    """A long run during which commits came (a 40-minute benchmark beside development) records the
    commit it started from, and the one at writing apart."""
    now = git_state()
    monkeypatch.setattr(results, "STARTED", now)
    write_result(str(tmp_path / "same.json"), {}, argv=["scripts/x.py"])
    prov = json.loads((tmp_path / "same.json").read_text())["provenance"]
    assert (prov["commit"], prov["dirty"]) == now and "written_at" not in prov
    monkeypatch.setattr(results, "STARTED", ("0" * 40, False))
    write_result(str(tmp_path / "later.json"), {}, argv=["scripts/x.py"])
    prov = json.loads((tmp_path / "later.json").read_text())["provenance"]
    assert (prov["commit"], prov["dirty"]) == ("0" * 40, False)
    assert prov["written_at"] == {"commit": now[0], "dirty": now[1]}


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_commit_and_dirty_flag_of_a_checkout(tmp_path):
    assert git_state(str(tmp_path)) == (None, None)  # not a repository

    def git(*args):
        return subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                              check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "a.txt").write_text("one\n")
    git("add", "a.txt")
    git("commit", "-q", "-m", "one")
    head = git("rev-parse", "HEAD")
    (tmp_path / "new.txt").write_text("untracked files do not count\n")
    assert git_state(str(tmp_path)) == (head, False)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "r.json").write_text("{}\n")
    git("add", "results/r.json")
    git("commit", "-q", "-m", "a result")
    head = git("rev-parse", "HEAD")
    (tmp_path / "results" / "r.json").write_text('{"rerun": true}\n')
    assert git_state(str(tmp_path)) == (head, False)  # a results file rewritten is no code changed
    (tmp_path / "a.txt").write_text("two\n")
    assert git_state(str(tmp_path)) == (head, True)


def test_the_suite_timer_reads_pytest_junit(tmp_path):
    """scripts/time_suite.py's reading of a JUnit report: a test's name, seconds and outcome."""
    from nosa.bench.suite_time import by_file, junit_tests

    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.serve.test_x" name="test_a[1]" time="12.5"/>'
        '<testcase classname="tests.test_y" name="test_b" time="0.25"><skipped message="no GPU"/></testcase>'
        '<testcase classname="tests.test_y" name="test_c" time="1"><failure message="boom"/></testcase>'
        '</testsuite></testsuites>')
    assert junit_tests(str(xml)) == [
        {"test": "tests/serve/test_x.py::test_a[1]", "seconds": 12.5, "outcome": "passed"},
        {"test": "tests/test_y.py::test_b", "seconds": 0.25, "outcome": "skipped"},
        {"test": "tests/test_y.py::test_c", "seconds": 1.0, "outcome": "failed"},
    ]
    assert by_file(junit_tests(str(xml))) == [{"file": "tests/serve/test_x.py", "seconds": 12.5, "tests": 1},
                                              {"file": "tests/test_y.py", "seconds": 1.2, "tests": 2}]


def test_the_docs_line_says_what_changed_while_a_run_ran(tmp_path):
    """A commit during the run and an edit during the run read differently under the figures."""
    from nosa.bench.report import provenance_line

    base = {"command": "python scripts/x.py", "commit": "a" * 40, "dirty": False, "machine": {}, "date": "2026-12-04"}
    cases = {"committed.json": {"commit": "b" * 40, "dirty": False}, "edited.json": {"commit": "a" * 40, "dirty": True}}
    for name, at in cases.items():
        (tmp_path / name).write_text(json.dumps({"provenance": {**base, "written_at": at}}))
    committed, edited = (provenance_line(tmp_path, name) for name in cases)
    assert "Written at commit `bbbbbbb`, committed while it ran." in committed
    assert "committed" not in edited and "Tracked files were edited while it ran." in edited


def test_the_suite_timer_measures_the_machines_speed_with_a_fixed_loop():
    """loop_seconds: a positive time for the loop, and more of it for ten times the iterations
    (no figure is asserted: the machine's speed is what it measures)."""
    from nosa.bench.suite_time import loop_seconds

    short, long = loop_seconds(100_000), loop_seconds(1_000_000)
    assert 0 < short and 0 < long and long >= short


def test_the_suite_timer_measures_how_busy_the_cores_were():
    """cpu_busy: the busy share of the machine's CPU time between two /proc/stat reads."""
    from nosa.bench.suite_time import busy_share, cpu_times

    assert busy_share((100.0, 400.0), (190.0, 500.0)) == 0.9  # 90 of 100 new jiffies busy
    assert busy_share(None, (1.0, 2.0)) is None and busy_share((5.0, 10.0), (5.0, 10.0)) is None
    now = cpu_times()
    if now is not None:  # Linux
        busy, total = now
        assert 0 < busy < total


def test_a_module_run_with_dash_m_is_written_as_one(tmp_path, monkeypatch):
    """``python -m nosa.plan`` records itself so, not as nosa/plan.py (which, run as a script, puts
    nosa/ first on the path, where nosa/select.py hides the standard library's select)."""
    import sys
    import types

    main = types.ModuleType("__main__")
    main.__spec__ = types.SimpleNamespace(name="nosa.plan")
    monkeypatch.setitem(sys.modules, "__main__", main)
    monkeypatch.setattr(sys, "argv", [os.path.join(REPO, "nosa", "plan.py"), "--calibrate-cpu", "results/serve.json"])
    assert results.provenance()["command"] == "python -m nosa.plan --calibrate-cpu results/serve.json"
    main.__spec__ = types.SimpleNamespace(name="nosa.train.__main__")  # python -m nosa.train
    assert results.provenance()["command"] == "python -m nosa.train --calibrate-cpu results/serve.json"
    main.__spec__ = None  # a script
    assert results.provenance()["command"] == "python nosa/plan.py --calibrate-cpu results/serve.json"
