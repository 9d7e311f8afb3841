"""Upgrade legacy NOSA checkpoints in place: ``python -m nosa.upgrade CKPT [CKPT ...]``.

A checkpoint written before the NOSA model types (model_type llama / qwen2 / qwen3 with a "nosa"
section in config.json) is NOSA only to nosa.from_pretrained and the server: a plain transformers
``from_pretrained`` builds the dense model from it. The upgrade rewrites config.json into the NOSA
format (nosa.checkpoint_format: model_type, architectures, auto_map) and writes modeling_nosa.py;
the weights and every other file stay as they are.

Atomic: modeling_nosa.py is written first (a legacy checkpoint ignores it) and config.json is
replaced by a rename, so an interrupted upgrade leaves the legacy checkpoint or the upgraded one.
Idempotent: a checkpoint already in the NOSA format is left as it is. A dense checkpoint, another
model type, a malformed "nosa" section or missing eviction heads exit with status 1 and a message,
touching nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from nosa.checkpoint_format import CODE_FILE, CODE_TEXT, kind, upgraded_config, write_code_file
from nosa.config import CONFIG_KEY
from nosa.eviction import MODULE_NAME, read_eviction_tensors
from nosa.hf import nosa_config_of


def upgrade(path: str) -> bool:
    """Bring the checkpoint directory ``path`` to the NOSA format. True if it changed, False if it
    already was. ValueError naming the problem for anything that is not a NOSA checkpoint."""
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    with open(config_path) as f:
        config = json.load(f)
    new = upgraded_config(config, source=config_path)
    if nosa_config_of(config, source=config_path) is None:
        raise ValueError(f"{config_path} has model_type {config['model_type']!r} but no '{CONFIG_KEY}' section")
    code_path = os.path.join(path, CODE_FILE)
    if kind(config) == "nosa" and new == config and _read(code_path) == CODE_TEXT:
        return False
    if not read_eviction_tensors(path):
        raise ValueError(f"{path} has a '{CONFIG_KEY}' section but no *.{MODULE_NAME}.* tensors (eviction heads)")
    write_code_file(path)
    tmp = config_path + ".upgrade-tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps(new, indent=2, sort_keys=True) + "\n")  # as transformers writes config.json
    os.replace(tmp, config_path)
    return True


def _read(path: str) -> str | None:
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return f.read()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nosa.upgrade", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+", metavar="CKPT", help="checkpoint directory (config.json inside)")
    args = parser.parse_args(argv)
    status = 0
    for path in args.checkpoints:
        try:
            changed = upgrade(path)
        except ValueError as err:
            print(f"nosa.upgrade: error: {err}", file=sys.stderr)
            status = 1
            continue
        print(f"{path}: {'upgraded to' if changed else 'already in'} the NOSA checkpoint format")
    return status


if __name__ == "__main__":
    sys.exit(main())
