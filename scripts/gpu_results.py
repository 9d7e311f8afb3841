"""Join what scripts/gpu_check.sh wrote into results/gpu_h200.json (the docs render it: docs/kernels.md).

    python scripts/gpu_results.py DIR [DIR ...] [--out results/gpu_h200.json] [--base results/gpu_h200.json]

Each DIR is one run's $OUT (its summary.json, the JSON of the steps it ran and logs.tar.gz). Later
folders win where two ran the same step, so a rerun of a few steps after a fix (GPU_CHECK_ONLY) joins
the earlier run's other steps; every part keeps its own provenance under "parts". ``--base`` starts
from a file joined earlier (a later session's runs, whose earlier folders are gone, replace only the
steps they ran).
"""

from __future__ import annotations

import argparse
import json
import re
import tarfile
import xml.etree.ElementTree as ET
from pathlib import Path

from nosa.bench.results import write_result

STEP_FILES = {"bench_kernels": "kernels_gpu.json", "bench_recall": "recall_gpu.json", "graph_check": "graph_check.json",
              "tune_prefill": "tune_prefill.json", "flashinfer_build": "flashinfer_build.json",
              "bench_flashinfer": "kernels_flashinfer.json", "train_speed": "train_gpu.json"}


def logs(folder: Path) -> dict[str, str]:
    """{name: text} of the run's logs and test reports (from logs.tar.gz, or loose files)."""
    out = {p.name: p.read_text(errors="replace") for p in folder.glob("*.log")}
    out.update({p.name: p.read_text(errors="replace") for p in folder.glob("*.xml")})
    archive = folder / "logs.tar.gz"
    if archive.exists():
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                if member.isfile():
                    out[member.name] = tar.extractfile(member).read().decode(errors="replace")
    return out


def junit(text: str) -> dict:
    """Counts and failing test ids of a pytest JUnit report."""
    suite = ET.fromstring(text)
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    failed = [f"{case.get('classname')}::{case.get('name')}" for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    total, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
    return {"passed": total - skipped - len(failed), "failed": len(failed), "skipped": skipped, "failures": failed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--out", default="results/gpu_h200.json")
    parser.add_argument("--note", default="", help="added to the provenance's note (e.g. which tree each run ran)")
    parser.add_argument("--base", type=Path, help="a file joined earlier: its steps stay where the folders ran none")
    parser.add_argument("--before", nargs="+", default=[], metavar="STEP",
                        help="for these steps, keep an earlier folder's result as STEP_before when a later "
                             "folder replaces it (a measurement before and after a fix)")
    args = parser.parse_args()
    result: dict = {"runs": []}
    parts: dict[str, dict] = {}  # step -> the provenance of the part kept (a later run's replaces it)
    if args.base:
        base = json.loads(args.base.read_text())
        earlier = base.pop("provenance", {}).get("note", "")
        notes = base.pop("earlier_notes", []) + ([earlier] if earlier else [])
        parts = {part["step"]: part for part in base.pop("parts", [])}
        result = base
    ran: set[str] = set()  # steps the folders of this join ran so far
    for folder in args.folders:
        summary = json.loads((folder / "summary.json").read_text())
        text = logs(folder)
        run = {"folder": folder.name, "steps": summary["steps"]}
        if "env.log" in text:
            result["env"] = [line for line in text["env.log"].splitlines() if line and not line.startswith("[")]
        if "gpu_tests.xml" in text and summary["steps"].get("tests", {}).get("rc") != 126:
            run["tests"] = result["tests"] = junit(text["gpu_tests.xml"])
            duration = re.search(r"in ([\d.]+)s", text.get("tests.log", ""))
            result["tests"]["seconds"] = float(duration.group(1)) if duration else None
        if "gpu_tests_flashinfer.xml" in text and summary["steps"].get("flashinfer_tests", {}).get("rc") != 126:
            run["flashinfer_tests"] = result["flashinfer_tests"] = junit(text["gpu_tests_flashinfer.xml"])
        result["runs"].append(run)
        for step, name in STEP_FILES.items():
            path = folder / name
            if path.exists():
                if step in args.before and step in ran:
                    result[f"{step}_before"] = result[step]
                    parts[f"{step}_before"] = dict(parts[step], step=f"{step}_before")
                ran.add(step)
                data = json.loads(path.read_text())
                parts[step] = dict(data.pop("provenance"), step=step, folder=folder.name)
                result[step] = data
    result["parts"] = list(parts.values())
    if args.base:
        result["earlier_notes"] = notes  # the notes of the joins before, oldest first
    write_result(args.out, result)
    # the figures are the GPU machine's: its machine line, not this one's (which only joined them)
    data = json.loads(Path(args.out).read_text())
    data["provenance"]["machine"] = result["parts"][0]["machine"] if result["parts"] else None
    data["provenance"]["note"] = f"Measured by scripts/gpu_check.sh on the lent GPU; joined here. {args.note}".strip()
    if args.base:
        data["provenance"]["note"] += f" Started from {args.base} as joined before (its notes: earlier_notes)."
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
