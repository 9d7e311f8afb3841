"""``python -m nosa.train --config configs/train/tiny.yaml [key=value ...]``

Also under ``torchrun --nproc_per_node N -m nosa.train ...`` or the ``deepspeed`` launcher.
Bad input (unknown key, missing file, inconsistent sizes, unsupported checkpoint) exits with a
one-line message before anything is written.
"""

from __future__ import annotations

import argparse
import os
import sys

from nosa.train.config import load_config
from nosa.train.data import offline_env
from nosa.train.loop import run


def main(argv: list[str] | None = None) -> int:
    offline_env()  # before transformers / datasets are imported: they read it once, at import
    os.environ.setdefault("WANDB_MODE", "offline")
    parser = argparse.ArgumentParser(prog="python -m nosa.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="YAML run config (configs/train/*.yaml)")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    parser.add_argument("overrides", nargs="*", help="key=value, dotted for sections: optim.lr=1e-3")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ValueError as err:
        raise SystemExit(f"nosa.train: error: {err}") from None
    try:
        run(cfg)
    except ValueError as err:
        raise SystemExit(f"nosa.train: error: {err}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
