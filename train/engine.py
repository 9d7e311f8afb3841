"""The DeepSpeed engine: process-group setup (gloo on CPU, nccl on GPU), the DeepSpeed JSON config
with our values filled in, and ``deepspeed.initialize`` with a plain torch AdamW (naming a DeepSpeed
optimizer would compile fused_adam / cpu_adam on first use)."""

from __future__ import annotations

import json
import math
import os

import torch

from nosa.net import free_port
from nosa.train.config import OptimSection


def init_distributed() -> tuple[int, int, str]:
    """Set up torch.distributed; returns (rank, world_size, device). A plain ``python -m`` run
    becomes a one-process group (DeepSpeed otherwise looks for MPI)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # optional: deepspeed reads DS_ACCELERATOR at import (set above)

    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo", verbose=False)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = f"cuda:{int(os.environ['LOCAL_RANK'])}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    return rank, world, device


def ds_config(path: str, micro_batch: int, grad_accum: int, grad_clip: float) -> dict:
    """The JSON at ``path`` with "auto" values resolved (bf16 only on CUDA; fp32 on CPU)."""
    with open(path) as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as err:
            raise ValueError(f"deepspeed config {path}: {err}") from err
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cfg["train_micro_batch_size_per_gpu"] = micro_batch
    cfg["gradient_accumulation_steps"] = grad_accum
    cfg["train_batch_size"] = micro_batch * grad_accum * world
    if cfg.get("gradient_clipping", "auto") == "auto":
        cfg["gradient_clipping"] = grad_clip
    bf16 = cfg.setdefault("bf16", {})
    if bf16.get("enabled", "auto") == "auto":
        bf16["enabled"] = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    if "optimizer" in cfg:
        raise ValueError(f"deepspeed config {path}: remove 'optimizer'; nosa.train builds AdamW itself")
    return cfg


def zero_stage(cfg: dict) -> int:
    return int(cfg.get("zero_optimization", {}).get("stage", 0))


def lr_lambda(warmup_steps: int, total: int, min_lr_ratio: float):
    """Linear warmup then cosine decay to ``min_lr_ratio`` of the peak, as a LambdaLR factor."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total - warmup_steps))
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def initialize(model, groups: list[dict], config: dict, optim: OptimSection, total: int):
    """-> DeepSpeed engine wrapping ``model`` with AdamW over ``groups`` (``optim.betas``) and a
    warmup-cosine LR over ``total`` steps (``optim.warmup_steps``, ``optim.min_lr_ratio``)."""
    import deepspeed  # optional: deepspeed reads DS_ACCELERATOR at import (init_distributed sets it)

    optimizer = torch.optim.AdamW(groups, betas=tuple(optim.betas))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(optim.warmup_steps, total, optim.min_lr_ratio))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine
