"""Servers and inputs of scripts/bench_offload.py: how each part starts its SGLang server (flags,
offloading environment, the decode parts' modes) and the hit-rate part's checkpoint variant
(eviction heads at A = 0) and prompts (the checkpoint's own synthetic tasks)."""

from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from nosa.bench.server.process import ServerProcess
from nosa.config import NosaConfig
from nosa.train.synthetic import make_example


def start_server(ckpt, args, log, env=None, threads=None, timeout: float = 600):
    env = dict(env or {})
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    # a long prefill forward on a shared 2-core CPU can outlast SGLang's 300 s scheduler watchdog
    return ServerProcess(ckpt, ["--skip-server-warmup", "--dtype", "float32", "--mem-fraction-static", "0.3",
                                "--watchdog-timeout", "7200", *args],
                         log, env=env).wait_ready(timeout=timeout)


def offload_env(host, device, stats):
    return {"NOSA_OFFLOAD": "1", "NOSA_HOST_KV_TOKENS": str(host), "NOSA_DEVICE_KV_TOKENS": str(device),
            "NOSA_SERVE_STATS_FILE": stats}


def zero_heads_copy(ckpt: str, dest: str) -> str:
    """The checkpoint with every eviction head's A set to 0 (training-free selection)."""
    shutil.copytree(ckpt, dest)
    for name in os.listdir(dest):
        if name.endswith(".safetensors"):
            tensors = load_file(os.path.join(dest, name))
            for key in tensors:
                if key.endswith(".nosa_evict.scale"):
                    tensors[key] = torch.zeros_like(tensors[key])
            save_file(tensors, os.path.join(dest, name), metadata={"format": "pt"})
    return dest


def task_prompts(ckpt: str, length: int, count: int, seed: int) -> list[list[int]]:
    """Synthetic examples of the run's own tasks (nosa_train.json) at ``length`` tokens, up to the answer."""
    tok = AutoTokenizer.from_pretrained(ckpt)
    run = os.path.join(ckpt, "nosa_train.json")
    tasks = ["passkey", "mqar"]
    if os.path.exists(run):
        with open(run) as f:
            tasks = (json.load(f).get("data", {}).get("synthetic") or {}).get("tasks") or tasks
    prompts = []
    for i in range(count):
        ex = make_example(tasks[i % len(tasks)], length, seed + i, measure=lambda s: len(tok(s)["input_ids"]))
        prompts.append(tok(ex["text"][: ex["targets"][0][0]])["input_ids"])
    return prompts


def decode_setup(args):
    """Contexts of the decode parts, and mode -> (server flags, environment) for their servers:
    "off" (KV in SGLang's pool), "on" (offloaded, a device budget of ``batch`` requests), "scheduled"
    (offloaded, with the recall scheduler)."""
    cfg = NosaConfig()
    contexts = [8192] if args.quick else args.contexts
    max_ctx = max(contexts) + args.decode_tokens + 16
    common = ["--attention-backend", "nosa", "--chunked-prefill-size", "4096", "--context-length", str(max_ctx),
              "--max-running-requests", str(args.batch)]
    host = args.batch * max_ctx + 1024

    def server_args(mode: str, stats: str):
        if mode == "off":
            return [*common, "--max-total-tokens", str(host)], {}
        env = offload_env(host, args.batch * cfg.budget_tokens, stats)
        if mode == "scheduled":
            env["NOSA_RECALL_SCHEDULER"] = "1"
        return [*common, "--page-size", str(cfg.block_size)], env

    return contexts, server_args
