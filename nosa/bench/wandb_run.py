"""An offline W&B run read back without network or W&B server (scripts/wandb_report.py): the
``run-*.wandb`` record log parsed directly into config, history and summary; printed or plotted.

The file is a LevelDB-style record log (7-byte file header, 32 KiB blocks, records with a 7-byte
header: crc32, length, type FULL/FIRST/MIDDLE/LAST) of wandb_internal_pb2.Record protobufs."""

from __future__ import annotations

import glob
import json
import os
import struct

BLOCK = 32768
FILE_HEADER = 7  # b":W&B" + magic (2 bytes) + version (1 byte)
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def find_run_file(path: str) -> str:
    """A .wandb file from: the file itself, an offline-run-* dir, or a dir holding wandb/ runs."""
    if os.path.isfile(path):
        return path
    for pattern in ("run-*.wandb", "*/run-*.wandb", "wandb/*/run-*.wandb", "*/wandb/*/run-*.wandb"):
        found = sorted(glob.glob(os.path.join(path, pattern)), key=os.path.getmtime)
        if found:
            return found[-1]
    raise SystemExit(f"wandb_report: no run-*.wandb file under {path!r}")


def read_records(file: str):
    """Yield the raw protobuf payloads of the record log."""
    with open(file, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        raise SystemExit(f"wandb_report: {file} is not a W&B run log")
    pos, pending = FILE_HEADER, b""
    while pos + 7 <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < 7:  # block trailer padding
            pos += left_in_block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            yield payload
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            yield pending + payload
            pending = b""
        elif kind == 0 and length == 0:
            pos += BLOCK - pos % BLOCK if pos % BLOCK else 0  # zero padding to the block end


def read_run(path: str) -> dict:
    """{"file", "config": {...}, "history": [{key: value, "_step": n}, ...], "summary": {...}}."""
    from wandb.proto import wandb_internal_pb2 as pb  # optional: wandb (the train extra)

    file = find_run_file(path)
    config, history, summary = {}, [], {}
    for payload in read_records(file):
        record = pb.Record()
        try:
            record.ParseFromString(payload)
        except Exception:  # a truncated tail of a run that is still being written
            continue
        kind = record.WhichOneof("record_type")
        if kind == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            history.append(row)
        elif kind in ("config", "run"):
            updates = record.config.update if kind == "config" else record.run.config.update
            for item in updates:
                key = item.key or "/".join(item.nested_key)
                config[key] = json.loads(item.value_json)
        elif kind == "summary":
            for item in record.summary.update:
                key = item.key or "/".join(item.nested_key)
                summary[key] = json.loads(item.value_json)
    config.pop("_wandb", None)
    return {"file": file, "config": config, "history": history, "summary": summary}


def print_report(run: dict) -> None:
    hist = run["history"]
    print(f"run log: {run['file']}")
    print(f"config keys: {sorted(run['config'])}")
    print(f"history: {len(hist)} rows")
    keys = sorted({k for row in hist for k in row if not k.startswith("_")})
    for key in keys:
        points = [(row.get("_step"), row[key]) for row in hist if key in row]
        first, last = points[0], points[-1]
        print(
            f"  {key:40s} n={len(points):4d} first={_fmt(first[1])} (step {first[0]}) "
            f"last={_fmt(last[1])} (step {last[0]})"
        )


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) else str(value)


def plot(run: dict, out: str) -> None:
    import matplotlib  # optional: matplotlib (the train extra)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # optional: matplotlib

    hist = run["history"]
    panels = [
        ("loss and its terms", [k for k in ("train/loss", "train/ce", "train/kl", "train/select", "eval/loss")]),
        ("eval accuracy", sorted({k for r in hist for k in r if k.startswith("eval/acc")})),
        ("eviction head A (mean)", sorted({k for r in hist for k in r if k.startswith("evict_A/")})),
        ("selection", [k for k in ("select/churn_mean", "select/churn_max", "select/mass")]),
    ]
    panels = [(title, keys) for title, keys in panels if any(k in r for r in hist for k in keys)]  # no empty panels
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.5), squeeze=False)
    axes = axes[0]
    for ax, (title, keys) in zip(axes, panels):
        for key in keys:
            pts = [(r["_step"], r[key]) for r in hist if key in r and "_step" in r]
            if pts:
                ax.plot(*zip(*pts), marker="." if len(pts) < 20 else None, label=key)
        lines = len(ax.get_legend_handles_labels()[0])
        ax.set_title(title if lines <= 8 else f"{title}, {lines} curves")  # one per layer: no legend
        ax.set_xlabel("step")
        if 0 < lines <= 8:
            ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


def summarise_run(run: dict, label: str) -> dict:
    """One run's figures for results JSON (scripts/wandb_report.py --summary): its steps, wall time
    (first to last step's W&B timestamp, the whole run and the steps alone), and per logged training
    key the mean of its first and of its last values (up to 10, a quarter of those logged)."""
    hist = [row for row in run["history"] if "train/loss" in row]
    if not hist:
        raise ValueError(f"{run['file']}: no training steps logged")
    every = [row for row in run["history"] if "_timestamp" in row]
    window = max(1, min(10, len(hist) // 4))
    keys = sorted({k for row in run["history"] for k in row
                   if k.startswith(("train/", "select/mass", "select/churn_mean")) and "/layer" not in k
                   and k not in ("train/phase", "train/tokens")})
    out = {"label": label, "out_dir": run["config"].get("out_dir"), "steps": len(hist),
           "seq_len": run["config"].get("seq_len"), "lr": run["config"].get("optim", {}).get("lr"),
           "kl_weight": run["config"].get("data", {}).get("kl_weight"),
           "select_weight": run["config"].get("data", {}).get("select_weight", 0.0),
           "run_seconds": every[-1]["_runtime"] if every else None,
           "step_seconds": hist[-1]["_timestamp"] - hist[0]["_timestamp"] if len(hist) > 1 else 0.0,
           "window": window, "first": {}, "last": {}}
    for key in keys:
        values = [row[key] for row in run["history"] if key in row and isinstance(row[key], (int, float))]
        if values:
            n = max(1, min(window, len(values) // 4))  # selection statistics come every few steps
            out["first"][key], out["last"][key] = sum(values[:n]) / n, sum(values[-n:]) / n
    return out

