"""How long the test suite takes (scripts/time_suite.py): one run of ``bash scripts/test.sh`` with a
JUnit report, its wall time, the outcome counts and the slowest tests, written with provenance."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
import xml.etree.ElementTree as ET

from nosa.bench import REPO
from nosa.bench.results import write_result


def junit_tests(path: str) -> list[dict]:
    """[{"test", "seconds", "outcome"}] of a JUnit XML file (pytest's --junitxml; ``seconds`` is the
    test's setup, call and teardown together)."""
    tests = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped":
                outcome = "skipped"
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        tests.append({"test": name, "seconds": round(float(case.get("time", 0.0)), 2), "outcome": outcome})
    return tests


def by_file(tests: list[dict]) -> list[dict]:
    """[{"file", "seconds", "tests"}] per test file, the longest first: where the suite's time goes
    (module-scoped servers and fixtures count in the file's first test)."""
    files: dict[str, dict] = {}
    for t in tests:
        name = t["test"].split("::")[0]
        f = files.setdefault(name, {"file": name, "seconds": 0.0, "tests": 0})
        f["seconds"] += t["seconds"]
        f["tests"] += 1
    return sorted(({**f, "seconds": round(f["seconds"], 1)} for f in files.values()), key=lambda f: -f["seconds"])


def cpu_times() -> tuple[float, float] | None:
    """(busy, total) CPU jiffies of the whole machine since boot, from /proc/stat (None elsewhere)."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)  # idle + iowait
    return sum(fields) - idle, sum(fields)


def busy_share(before, after) -> float | None:
    """The share of the machine's CPU time that was busy between two ``cpu_times()``: near 1, the
    suite is bound by the cores and more workers cannot shorten it; well below 1, it waits."""
    if before is None or after is None or after[1] <= before[1]:
        return None
    return round((after[0] - before[0]) / (after[1] - before[1]), 3)


SPEED_LOOP = 20_000_000  # iterations of loop_seconds' fixed loop: a few seconds on one core


def loop_seconds(n: int = SPEED_LOOP) -> float:
    """Seconds one core takes for a fixed pure-Python loop of ``n`` additions: the machine's speed
    around a run. A shared VM's speed moves by tens of percent within an hour (the same tests took a
    third longer an hour apart here), so two suite times compare only beside their loops."""
    start, total = time.perf_counter(), 0
    for i in range(n):
        total += i
    return time.perf_counter() - start


def run(args) -> dict:
    """Run the suite once (``args.pytest_args`` appended), write ``args.out``; returns the result."""
    with tempfile.TemporaryDirectory(prefix="nosa-suite-") as work:
        junit = os.path.join(work, "junit.xml")
        command = ["bash", "scripts/test.sh", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
                   *args.pytest_args]
        loop_before = loop_seconds()
        start, cpu_before = time.perf_counter(), cpu_times()
        done = subprocess.run(command, cwd=REPO)
        wall, busy = time.perf_counter() - start, busy_share(cpu_before, cpu_times())
        loop_after = loop_seconds()
        tests = junit_tests(junit) if os.path.exists(junit) else []
    counts = {kind: sum(t["outcome"] == kind for t in tests) for kind in ("passed", "skipped", "failed")}
    slowest = sorted(tests, key=lambda t: -t["seconds"])[: args.slowest]
    result = {"suite_command": " ".join(command[:2] + list(args.pytest_args)), "exit_code": done.returncode,
              "wall_seconds": round(wall, 1), "workers": 2,
              "cpu_busy": busy, "cores": os.cpu_count(),
              "speed_loop_seconds": [round(loop_before, 2), round(loop_after, 2)], "tests": counts,
              "test_seconds_total": round(sum(t["seconds"] for t in tests), 1), "slowest": slowest,
              "files": by_file(tests)}
    write_result(args.out, result)
    if getattr(args, "all_tests", None):  # every test's seconds, for finding what to cut
        with open(args.all_tests, "w") as f:
            json.dump(sorted(tests, key=lambda t: -t["seconds"]), f, indent=1)
    print(f"suite: {counts} in {wall:.0f} s (exit {done.returncode}); wrote {args.out}")
    return result
