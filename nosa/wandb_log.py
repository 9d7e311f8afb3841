"""Logging: W&B (offline unless the user configures otherwise) plus ``metrics.jsonl`` in the run
directory. Only rank 0 logs; other ranks get the same object with every method a no-op, so the
training loop never checks ranks."""

from __future__ import annotations

import json
import os


class Logger:
    def __init__(
        self,
        out_dir: str,
        config: dict,
        mode: str | None,
        project: str,
        name: str | None,
        wandb_dir: str | None,
        rank: int = 0,
    ):
        self.active = rank == 0
        self.run = None
        self._file = None
        if not self.active:
            return
        os.makedirs(out_dir, exist_ok=True)
        self._file = open(os.path.join(out_dir, "metrics.jsonl"), "a")
        mode = mode or os.environ.get("WANDB_MODE") or "offline"
        if mode == "disabled":
            return
        os.environ["WANDB_MODE"] = mode
        os.environ.setdefault("WANDB_SILENT", "true")
        wandb_dir = wandb_dir or out_dir
        os.makedirs(wandb_dir, exist_ok=True)
        import wandb  # optional: wandb (the [train] extra; it reads WANDB_MODE, set above)

        self.run = wandb.init(
            project=project, name=name, dir=wandb_dir, config=config, mode=mode, reinit="finish_previous"
        )

    @property
    def run_dir(self) -> str | None:
        return None if self.run is None else os.path.dirname(self.run.dir)  # .../offline-run-*

    def log(self, metrics: dict, step: int) -> None:
        if not self.active:
            return
        metrics = {k: (float(v) if hasattr(v, "__float__") else v) for k, v in metrics.items()}
        self._file.write(json.dumps(dict(metrics, step=step)) + "\n")
        self._file.flush()
        if self.run is not None:
            self.run.log(metrics, step=step)

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self.run is not None:
            self.run.finish()
            self.run = None
