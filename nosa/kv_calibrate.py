"""Calibrate a checkpoint's host KV key factors: ``python -m nosa.kv_calibrate CKPT``.

An int8 host pool (``NOSA_HOST_KV_DTYPE=int8``) divides every key by one factor per layer, KV head
and channel before it takes the token's scale (nosa.kvquant says why). This runs the checkpoint over
a few windows of prose (nosa.train.prose's training documents: never the held-out ones the
benchmarks score), takes each channel's largest |key| (after RoPE and any key norm: the keys a pool
stores) in every NOSA layer, and writes the factors (nosa.kvquant.key_factors) beside the weights as
``nosa_kv_factors.safetensors``, atomically. The server reads it at start-up; a checkpoint without it
keeps one scale per token and says so in the log. Rerun it after a fine-tune changes the keys.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from safetensors.torch import load_file, save_file

from nosa import kvquant


def _is_factor_table(f: torch.Tensor) -> bool:
    """Whether ``f`` is a key factor table: [Hkv, D], every factor finite and positive."""
    return f.dim() == 2 and bool(torch.isfinite(f).all()) and bool((f > 0).all())


def save_key_factors(model_dir: str, factors: dict[int, torch.Tensor], metadata: dict[str, str]) -> str:
    """Write ``factors`` ({layer index: [Hkv, D] float32}) into ``model_dir``/kvquant.KEY_FACTORS_FILE
    atomically (a temporary file, then a rename: a stopped calibration leaves the old file or none).
    Returns the path."""
    for layer, f in factors.items():
        if not _is_factor_table(f):
            raise ValueError(f"save_key_factors: layer {layer}: expected finite positive [Hkv, D] factors, "
                             f"got shape {tuple(f.shape)}")
    path = os.path.join(model_dir, kvquant.KEY_FACTORS_FILE)
    tmp = path + ".tmp"
    save_file({f"layers.{layer}.k": f.float().contiguous() for layer, f in factors.items()}, tmp, metadata=metadata)
    os.replace(tmp, path)
    return path


def load_key_factors(model_dir: str) -> dict[int, torch.Tensor] | None:
    """{layer index: [Hkv, D] float32} from ``model_dir``/kvquant.KEY_FACTORS_FILE, or None without one;
    ValueError naming the file when a tensor is not a positive finite [Hkv, D] factor table."""
    path = os.path.join(model_dir, kvquant.KEY_FACTORS_FILE)
    if not os.path.isfile(path):
        return None
    out = {}
    for key, f in load_file(path).items():
        parts = key.split(".")
        if len(parts) != 3 or parts[0] != "layers" or parts[2] != "k" or not parts[1].isdigit():
            raise ValueError(f"{path}: unexpected tensor {key!r} (expected layers.<i>.k)")
        if not _is_factor_table(f):
            raise ValueError(f"{path}: {key} must be finite positive factors [Hkv, D], got shape {tuple(f.shape)}")
        out[int(parts[1])] = f.float()
    return out


def key_amax(model, windows: list[torch.Tensor], progress: bool = True) -> dict[int, torch.Tensor]:
    """{layer index: largest |key| [Hkv, D] float32} of every NOSA layer of ``model`` over ``windows``
    (token ids [1, T] each)."""
    from tqdm import tqdm  # optional: tqdm (the train extra)

    from nosa.hf import capture_attention_inputs, nosa_attention_modules  # optional: transformers

    layer_of = {name: m.layer_idx for name, m in nosa_attention_modules(model)}
    amax: dict[int, torch.Tensor] = {}
    with torch.no_grad(), capture_attention_inputs(model) as captured:
        for ids in tqdm(windows, desc="calibrating", unit="window", disable=not progress, dynamic_ncols=True):
            model(ids.to(model.device))
            for name, (_, k, _) in captured.items():
                a = k.float().abs().amax(dim=0).cpu()  # [Hkv, D]
                layer = layer_of[name]
                amax[layer] = a if layer not in amax else torch.maximum(amax[layer], a)
            captured.clear()
    return amax


def calibrate(model_dir: str, length: int = 2048, windows: int = 2, progress: bool = True) -> str:
    """Write ``model_dir``'s key factors; returns the file's path."""
    from transformers import AutoTokenizer  # optional: transformers

    import nosa  # optional: transformers (nosa.from_pretrained)
    from nosa.train import prose  # optional: the train extra's prose

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = nosa.from_pretrained(model_dir).eval()
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None) or length
    length = min(length, limit)
    train_docs, _ = prose.split(prose.documents())
    try:
        rows = [torch.tensor([ids]) for ids in prose.token_windows(tokenizer, train_docs, length, windows)]
    except ValueError as e:
        raise SystemExit(f"kv_calibrate: {e}") from None
    amax = key_amax(model, rows, progress)
    factors = {layer: kvquant.key_factors(a) for layer, a in sorted(amax.items())}
    meta = {"format": "nosa host KV key factors v1", "calibration": f"{windows} windows of {length} tokens of "
            "nosa.train.prose training documents", "floor": str(kvquant.FACTOR_FLOOR)}
    return save_key_factors(model_dir, factors, meta)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nosa.kv_calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", help="checkpoint folder (dense or NOSA; python -m nosa.models, nosa.train)")
    parser.add_argument("--length", type=int, default=2048, help="tokens per prose window (default 2048, at "
                        "most the model's positions)")
    parser.add_argument("--windows", type=int, default=2, help="windows of prose (default 2)")
    args = parser.parse_args(argv)
    if args.length < 16 or args.windows < 1:
        parser.error("--length must be at least 16 and --windows at least 1")
    path = calibrate(args.model_dir, args.length, args.windows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
