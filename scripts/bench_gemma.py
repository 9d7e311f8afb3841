"""Gemma 3 270M served at long context: SGLang's torch_native, nosa with offloading off (every layer's
KV in SGLang's pool) and nosa with offloading and the recall scheduler, side by side in one run.

    python scripts/bench_gemma.py --quick                  # 8K, about 6 minutes on 2 cores
    python scripts/bench_gemma.py --context 16384          # -> results/gemma3_serve.json (32K: about an hour here)
    python scripts/bench_gemma.py --captured 2048 8192 32768   # CPU graph runner vs eager, one 32K server each
    python scripts/bench_gemma.py --onoff 3                # offloading on vs off at 32K, 3 paired rounds (~20 min)

``--captured CONTEXTS``: instead of the three servers, nosa with offloading and the recall scheduler
served twice, eager and under SGLang's CPU graph runner (``--enable-torch-compile``, one graph: batch
1), each server sized for ``--context`` and given one request of each of CONTEXTS tokens in turn
(-> results/gemma3_captured.json: decode ms per step of both, per context).

``--onoff ROUNDS``: offloading's own cost, paired. The two nosa servers (offloading off; offloading
and the recall scheduler on) are both started, all but the measured one paused (SIGSTOP, as
bench_serve's ``--interleave``), and each round gives each one request of ``--context`` tokens, a
different server first each round, so the two of a round ran a few minutes apart on the same
machine (-> results/gemma3_onoff.json: per round both servers' prefill and decode, the on/off
ratios per round and their medians). A single run's ratio moved by tens of percent here.

Each server gets one request of ``--context`` tokens (<bos>, then random ids) and streams
``--new-tokens`` greedy tokens (bench_serve's measurement: prefill seconds until the first token,
decode ms per step as the median interval between streamed tokens). The checkpoint is the dense
``--model`` (python -m nosa.models gemma3-270m) served by nosa with training-free selection (A = 0)
at ``--share`` of the context's blocks of 64 tokens; the eviction heads do not change the bytes.

Device KV per request, counted from what each server allocates per token and per request:
- torch_native: SGLang's pool keeps K and V of all 18 layers for every token (it disables its hybrid
  SWA pool for Gemma 3): layers x KV heads x (head_dim + v_head_dim) x dtype bytes per token; the
  script checks it against the K and V sizes SGLang logs;
- nosa with offloading: per request its device block slots in the 3 full layers (the budget, K, V
  and the float32 eviction score per token), the 15 sliding layers' rings of ``sliding_window``
  tokens and its decode states (both logged by the backend, for every request row and SGLang's
  padding row).
Capacity: how many such requests fit the device bytes torch_native needs for one of them (less the
padding row's rings and states). Not a
test: nothing is asserted. Writes JSON with provenance.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time

import torch

from nosa.bench.offload.servers import offload_env, start_server
from nosa.bench.results import write_result
from nosa.bench.server.measure import measure
from nosa.bench.server.process import stop_all
from nosa.bench.server.stats import offload_counters
from nosa.checkpoint_format import nosa_layers
from nosa.config import NosaConfig

BLOCK = 64
SERVER_FLAGS = ["--disable-radix-cache", "--chunked-prefill-size", "4096"]  # every server here, beside its context
MARGIN = 8  # tokens of the context the request leaves free
# SGLang's admission reserves a page beyond a request's tokens: a pool of exactly the context never
# admits the request (its scheduler retries forever, no error), so a pool sized here gets a margin
POOL_MARGIN = 256


def nosa_config(context: int, share: float) -> NosaConfig:
    """Blocks of 64 tokens, a budget of ``share`` of the context's blocks: 1 sink, a window of a
    quarter of the budget, two query-aware picks, the rest ranked."""
    budget = max(8, int(context / BLOCK * share))
    return NosaConfig(block_size=BLOCK, compress_kernel=32, compress_stride=16, sink_blocks=1,
                      window_blocks=max(2, budget // 4), query_blocks=2, topk_blocks=budget, dense_len=0)


def offloaded_env(context: int, cfg: NosaConfig, stats: str) -> dict:
    """The environment of a nosa server with offloading and the recall scheduler: a host pool for
    ``context`` tokens and a margin, device slots for one request's budget."""
    return {**offload_env(context + 4096, cfg.topk_blocks * BLOCK, stats), "NOSA_CONFIG": cfg.to_json(),
            "NOSA_RECALL_SCHEDULER": "1"}


def nosa_off(context: int, cfg: NosaConfig) -> tuple[list[str], dict]:
    """Flags and environment of nosa with offloading off: every layer's KV in SGLang's pool, sized
    for ``context`` tokens and the margin (beside --context-length and SERVER_FLAGS)."""
    flags = ["--attention-backend", "nosa", "--max-total-tokens", str(context + POOL_MARGIN), "--page-size", str(BLOCK)]
    return flags, {"NOSA_CONFIG": cfg.to_json()}


def prompt(context: int, new_tokens: int, vocab: int, bos: int) -> list[int]:
    """<bos> and random ids: with its new tokens, MARGIN tokens short of ``context`` (SGLang cuts a
    request's new tokens where prompt + new tokens reach the context length)."""
    g = torch.Generator().manual_seed(0)
    return [bos] + torch.randint(1000, vocab, (context - new_tokens - MARGIN - 1,), generator=g).tolist()


def logged(log: str, pattern: str) -> re.Match:
    found = re.search(pattern, log)
    if found is None:
        raise RuntimeError(f"the server log lacks {pattern!r}")
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/gemma3-270m", help="the dense Gemma 3 checkpoint")
    parser.add_argument("--context", type=int, default=32768, help="request length in tokens (--quick: 8192)")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens streamed per request")
    parser.add_argument("--share", type=float, default=0.25, help="NOSA's budget as a share of the blocks")
    parser.add_argument("--threads", type=int, default=2, help="OMP threads of each server")
    parser.add_argument("--quick", action="store_true", help="8K instead of --context")
    parser.add_argument("--captured", type=int, nargs="+", default=None, metavar="CONTEXT",
                        help="request lengths served eager and under the CPU graph runner by servers sized for "
                             "--context (instead of the three servers)")
    parser.add_argument("--onoff", type=int, default=0, metavar="ROUNDS",
                        help="paired rounds of the two nosa servers, offloading off and on, both up and "
                             "measured in turn (instead of the three servers)")
    parser.add_argument("--out", default=None, help="JSON output (default results/gemma3_serve.json; --quick: "
                        "results/gemma3_serve_quick.json; --captured: results/gemma3_captured.json; --onoff: "
                        "results/gemma3_onoff.json)")
    args = parser.parse_args(argv)
    if args.captured and args.onoff:
        parser.error("--captured and --onoff are two different runs: give one")
    if args.onoff < 0:
        parser.error(f"--onoff takes a number of rounds, got {args.onoff}")
    if args.captured:
        return captured(args)
    if args.onoff:
        return onoff(args)
    context = 8192 if args.quick else args.context
    out_path = args.out or ("results/gemma3_serve_quick.json" if args.quick else "results/gemma3_serve.json")
    with open(os.path.join(args.model, "config.json")) as f:
        hf = json.load(f)
    full = nosa_layers(hf)
    layers, hkv, dim, window = hf["num_hidden_layers"], hf["num_key_value_heads"], hf["head_dim"], hf["sliding_window"]
    itemsize = 4  # --dtype float32 (the CPU engine)
    cfg = nosa_config(context, args.share)
    ids = prompt(context, args.new_tokens, hf["vocab_size"], hf["bos_token_id"])
    limit = str(context)  # the prompt and its new tokens fill it but MARGIN (Gemma 3: at most 32768)
    pool = str(context + POOL_MARGIN)
    report = {"model": args.model, "context": context, "new_tokens": args.new_tokens, "dtype": "float32",
              "layers": layers, "full_layers": full, "sliding_window": window, "nosa_config": cfg.to_dict()}
    work = tempfile.mkdtemp(prefix="bench_gemma_")

    def served(name: str, flags: list[str], env: dict | None = None) -> tuple[dict, str]:
        """One server with ``flags`` (and the flags every server here shares) given the request:
        (bench_serve's measurement, the server's log)."""
        log = os.path.join(work, f"{name}.log")
        server = start_server(args.model, [*flags, "--context-length", limit, *SERVER_FLAGS], log, env=env,
                              threads=args.threads)
        try:
            measured = measure(server, [ids], args.new_tokens)
        finally:
            server.stop()
        with open(log, errors="replace") as f:
            return measured, f.read()

    # ---- torch_native: the whole context of every layer in SGLang's pool --------------------------
    native, text = served("native", ["--attention-backend", "torch_native", "--max-total-tokens", pool])
    found = logged(text, r"KV Cache is allocated\. dtype: \S+, #tokens: (\d+), "
                         r"K size: ([\d.]+) GB, V size: ([\d.]+) GB")
    per_token = layers * hkv * 2 * dim * itemsize
    native["kv_bytes_per_token"] = per_token
    native["logged_pool"] = {"tokens": int(found[1]), "k_gb": float(found[2]), "v_gb": float(found[3]),
                             "computed_gb": round(int(found[1]) * per_token / 1e9, 2)}
    native["device_kv_bytes_per_request"] = per_token * context
    report["torch_native"] = native
    print(json.dumps({"torch_native": native}), flush=True)

    # ---- nosa, offloading off: the same pool as torch_native, NOSA's selection on the full layers ----
    off_flags, off_env = nosa_off(context, cfg)
    report["nosa_off"], _ = served("nosa_off", off_flags, env=off_env)
    report["nosa_off"]["device_kv_bytes_per_request"] = per_token * context
    print(json.dumps({"nosa_off": report["nosa_off"]}), flush=True)

    # ---- nosa: the full layers offloaded, the sliding layers' windows on the device -------------
    stats = os.path.join(work, "stats.json")
    env = offloaded_env(context, cfg, stats)
    offloaded, text = served("nosa", ["--attention-backend", "nosa", "--page-size", str(BLOCK)], env=env)
    states = logged(text, r"decode states of (\d+) request rows, contexts up to \d+ tokens: ([\d.]+) MiB")
    rings = logged(text, r"(\d+) sliding-window layers \(window \d+\) on the device: "
                         r"([\d.]+) MiB for (\d+) request rows")
    slots = cfg.topk_blocks * BLOCK * hkv * len(full) * (2 * dim * itemsize + 4)  # K, V and cis per slot token
    # rings and decode states are allocated for every request row plus SGLang's padding row 0
    per_request = {"block_slots": slots,
                   "sliding_windows": int(float(rings[2]) * 2**20 / (int(rings[3]) + 1)),
                   "decode_states": int(float(states[2]) * 2**20 / (int(states[1]) + 1))}
    offloaded["device_kv_bytes_per_request"] = sum(per_request.values())
    offloaded["device_bytes_per_request_parts"] = per_request
    padding_row = per_request["sliding_windows"] + per_request["decode_states"]
    offloaded["host_kv_bytes_per_token"] = len(full) * hkv * (2 * dim * itemsize + 4)
    offloaded.update(offload_counters(stats))
    steps = max(1, offloaded["layer_steps"] // len(full))
    offloaded["recalled_bytes_per_step"] = round(offloaded["recalled_bytes"] / steps)
    report["nosa_offload"] = offloaded
    budget = native["device_kv_bytes_per_request"]
    report["capacity"] = {
        "device_budget_bytes": budget, "torch_native_requests": 1,
        "nosa_offload_requests": (budget - padding_row) // offloaded["device_kv_bytes_per_request"],
    }
    report["decode_speed_nosa_over_native"] = round(native["ms_per_decode_step"] / offloaded["ms_per_decode_step"], 3)
    report["prefill_nosa_over_native"] = round(offloaded["prefill_s"] / native["prefill_s"], 3)
    # offloading's own cost: the same selection with the KV in SGLang's pool against offloaded
    report["offload_on_over_off_decode_speed"] = round(report["nosa_off"]["ms_per_decode_step"]
                                                       / offloaded["ms_per_decode_step"], 3)
    report["offload_prefill_over_off"] = round(offloaded["prefill_s"] / report["nosa_off"]["prefill_s"], 3)
    print(json.dumps({k: report[k] for k in ("capacity", "decode_speed_nosa_over_native", "prefill_nosa_over_native",
                                             "offload_on_over_off_decode_speed", "offload_prefill_over_off")}),
          flush=True)
    write_result(out_path, report)
    print(f"wrote {out_path}")
    return 0


def captured(args) -> int:
    """Decode per request length, eager against SGLang's CPU graph runner, offloading and the recall
    scheduler on, both servers sized for ``--context``."""
    if max(args.captured) > args.context:
        raise SystemExit(f"--captured: every request length must fit --context ({args.context})")
    with open(os.path.join(args.model, "config.json")) as f:
        hf = json.load(f)
    cfg = nosa_config(args.context, args.share)
    work = tempfile.mkdtemp(prefix="bench_gemma_")
    env = offloaded_env(args.context, cfg, os.path.join(work, "stats.json"))
    flags = ["--attention-backend", "nosa", "--page-size", str(BLOCK), "--context-length", str(args.context),
             *SERVER_FLAGS]
    report = {"model": args.model, "server_context": args.context, "contexts": args.captured,
              "new_tokens": args.new_tokens, "dtype": "float32", "nosa_config": cfg.to_dict(), "servers": {}}
    for name, extra in (("eager", []), ("captured", ["--enable-torch-compile", "--cuda-graph-bs-decode", "1"])):
        log = os.path.join(work, f"{name}.log")
        start = time.perf_counter()  # the graph runner compiles the whole model at start-up: minutes here
        server = start_server(args.model, [*flags, *extra], log, env=env, threads=args.threads, timeout=3600)
        start_s = time.perf_counter() - start
        try:
            rows = []
            for context in args.captured:
                rows.append({"context": context,
                             **measure(server, [prompt(context, args.new_tokens, hf["vocab_size"], hf["bos_token_id"])],
                                       args.new_tokens)})
                print(json.dumps({name: rows[-1]}), flush=True)
        finally:
            server.stop()
        report["servers"][name] = {"server_start_s": round(start_s, 1), "results": rows}
    eager, graphs = (report["servers"][n]["results"] for n in ("eager", "captured"))
    report["captured_over_eager_speed"] = {
        str(e["context"]): round(e["ms_per_decode_step"] / g["ms_per_decode_step"], 3) for e, g in zip(eager, graphs)}
    print(json.dumps(report["captured_over_eager_speed"]), flush=True)
    out = args.out or "results/gemma3_captured.json"
    write_result(out, report)
    print(f"wrote {out}")
    return 0


def weight_bytes(model_dir: str) -> int:
    """Bytes of every weight of the checkpoint (its safetensors' headers; float32 here)."""
    from safetensors import safe_open  # optional: safetensors (transformers brings it)

    size = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}
    total = 0
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), "pt") as f:
                for key in f.keys():
                    part = f.get_slice(key)
                    total += math.prod(part.get_shape()) * size[part.get_dtype()]
    return total


def decode_bytes(model_dir: str, hf: dict, context: int, cfg: NosaConfig, itemsize: int = 4) -> dict:
    """What one decode step of one request at ``context`` tokens must read, in bytes: every weight
    once (the tied embedding as the LM head), and its KV. torch_native reads every layer's whole
    context (SGLang's torch_native masks a sliding layer's window out of the whole context); nosa
    reads the full layers' budget, the compressed keys its selection scores, and the sliding
    layers' windows. A step bound by these bytes (a GPU's decode) is at most ``bound`` times
    faster with nosa."""
    full = len(nosa_layers(hf))
    per_token = hf["num_key_value_heads"] * 2 * hf["head_dim"] * itemsize  # K and V of one layer
    weights = weight_bytes(model_dir)
    native = hf["num_hidden_layers"] * per_token * context
    budget = full * per_token * min(context, cfg.topk_blocks * cfg.block_size)
    compressed = full * cfg.num_compressed(context) * hf["num_key_value_heads"] * hf["head_dim"] * itemsize
    windows = (hf["num_hidden_layers"] - full) * per_token * min(context, hf["sliding_window"])
    nosa = budget + compressed + windows
    return {"weights": weights, "lm_head": hf["vocab_size"] * hf["hidden_size"] * itemsize,
            "torch_native_kv": native, "nosa_kv": nosa,
            "nosa_kv_parts": {"budget": budget, "compressed_keys": compressed, "sliding_windows": windows},
            "bound": round((weights + native) / (weights + nosa), 3)}


def onoff(args) -> int:
    """Offloading on against off at ``--context``: both nosa servers up, measured in turn, a
    different one first each round; the JSON's ratios are medians over the rounds."""
    with open(os.path.join(args.model, "config.json")) as f:
        hf = json.load(f)
    context = args.context
    cfg = nosa_config(context, args.share)
    ids = prompt(context, args.new_tokens, hf["vocab_size"], hf["bos_token_id"])
    work = tempfile.mkdtemp(prefix="bench_gemma_")
    off_flags, off_env = nosa_off(context, cfg)
    setups = {"nosa_off": (off_flags, off_env),
              "nosa_offload": (["--attention-backend", "nosa", "--page-size", str(BLOCK)],
                               offloaded_env(context, cfg, os.path.join(work, "stats.json")))}
    servers = {}
    report = {"model": args.model, "context": context, "new_tokens": args.new_tokens, "dtype": "float32",
              "rounds": args.onoff, "nosa_config": cfg.to_dict(),
              "decode_bytes": decode_bytes(args.model, hf, context, cfg), "results": []}
    try:
        for name, (server_flags, env) in setups.items():
            servers[name] = start_server(args.model, [*server_flags, "--context-length", str(context), *SERVER_FLAGS],
                                         os.path.join(work, f"{name}.log"), env=env, threads=args.threads)
            servers[name].pause()
        names = list(servers)
        for round_ in range(args.onoff):
            for name in names[round_ % 2:] + names[: round_ % 2]:
                servers[name].resume()
                try:
                    row = {"server": name, "round": round_, **measure(servers[name], [ids], args.new_tokens)}
                finally:
                    servers[name].pause()
                report["results"].append(row)
                print(json.dumps(row), flush=True)
    finally:
        stop_all(servers.values())
    by_round = {}
    for r in report["results"]:
        by_round.setdefault(r["round"], {})[r["server"]] = r
    report["by_round"] = [{"round": k,
                           "decode_speed_on_over_off": round(v["nosa_off"]["ms_per_decode_step"]
                                                             / v["nosa_offload"]["ms_per_decode_step"], 3),
                           "prefill_on_over_off": round(v["nosa_offload"]["prefill_s"] / v["nosa_off"]["prefill_s"], 3)}
                          for k, v in sorted(by_round.items())]
    for key in ("decode_speed_on_over_off", "prefill_on_over_off"):
        report[key] = statistics.median(r[key] for r in report["by_round"])
    print(json.dumps({k: report[k] for k in ("by_round", "decode_speed_on_over_off", "prefill_on_over_off")}),
          flush=True)
    out = args.out or "results/gemma3_onoff.json"
    write_result(out, report)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
