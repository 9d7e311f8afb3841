"""Decode throughput of SGLang's "nosa" backend vs "torch_native" on the same tiny model.

    .venv/bin/python scripts/bench_serve.py [--quick] [--contexts 4096 8192 32768 65536] [--out results/serve.json]
    .venv/bin/python scripts/bench_serve.py --backends nosa --tp-sizes 1 2 --evict-scale 1 --contexts 32768

Builds a tiny random Llama (2 layers, hidden 256, GQA 8/2; a dense checkpoint, so the backend uses
the released NosaConfig defaults: 64 blocks of 64 tokens, dense_len 4096), then for each backend
(and tensor-parallel size, ``--tp-sizes``) starts one server (stopped before the next starts: an
idle server keeps a core busy) and, for each context length, sends ``--batch`` concurrent greedy
requests with streaming (see ``measure``: the decode step time is the median interval between
streamed tokens while the whole batch decodes, so prefill and request handling are excluded).
Contexts above the model's dense_len (4096) are where NOSA's selection applies.
``--evict-scale A`` (A > 0) converts the model to a NOSA checkpoint with random eviction heads of
scale A, so that under tensor parallelism the ranks exchange the eviction heads' partial sums
(a dense checkpoint's A = 0 heads need no other rank). On CPU a TP server gets
SGLANG_CPU_OMP_THREADS_BIND, one share of the cores per rank (nosa.serve.tools.process.cpu_binding),
and each rank runs ``--threads`` torch threads.

``--py-spy DIR`` also samples the server's scheduler process (the one running the forward passes)
with py-spy (``pip install py-spy``) while each context is measured: the raw stacks go to
``DIR/<backend>_tp<N>_<context>.txt`` (rank 0's scheduler under TP), and each result row gets
``extend_profile``, the functions under the attention backend's ``forward_extend`` (prefill) with
their share of its samples.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build_model(path: str, evict_scale: float = 0.0) -> None:
    """The tiny Llama; with ``evict_scale`` > 0 a NOSA checkpoint (default NosaConfig, random
    eviction heads of scale ``evict_scale``)."""
    import nosa
    from nosa.serve.tools.tiny_checkpoint import make_tokenizer
    from nosa.tiny import set_eviction_heads, tiny_llama

    model = tiny_llama(layers=2, hidden=256, heads=8, kv_heads=2, vocab=320, seed=0, intermediate=512,
                       max_positions=131072, bos_token_id=256, eos_token_id=257, tie_word_embeddings=False)
    if evict_scale > 0:
        nosa.convert(model, nosa.NosaConfig())
        set_eviction_heads(model, scale=evict_scale, std=0.3, seed=0, bias_std=0.3)
    model.save_pretrained(path)
    make_tokenizer(path)


def stream_generate(url: str, prompt: list[int], new_tokens: int, start: float, out: list) -> None:
    """Greedy generation with streaming; appends (seconds since ``start``, tokens so far) per chunk."""
    body = {"input_ids": prompt, "stream": True,
            "sampling_params": {"temperature": 0.0, "max_new_tokens": new_tokens, "ignore_eos": True}}
    req = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=7200) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[len(b"data:"):])
            out.append((time.perf_counter() - start, int(chunk["meta_info"]["completion_tokens"])))


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(server, context: int, batch: int, new_tokens: int, warm_up: bool = False,
            cpu_pid: int | None = None) -> dict | None:
    """One batch of ``batch`` concurrent greedy requests of ``context`` random prompt tokens, streamed.

    Prefill: until every request has its first token (``prefill_s``; with ``cpu_pid``, the server's
    scheduler process, also its CPU seconds over that time, ``prefill_cpu_s``: less sensitive than
    wall time to other load on a shared machine). Decode: the intervals between streamed tokens
    once every request is decoding (the whole batch in each step), per token; the median over all
    requests and steps is the step time (robust to a noisy machine), the mean is reported too.
    Nothing here depends on the prefix cache or on work done before the first token."""
    import statistics

    import torch

    server.post("/flush_cache", {})
    g = torch.Generator().manual_seed(context)
    prompts = [torch.randint(0, 256, (context,), generator=g).tolist() for _ in range(batch)]
    cpu_start = cpu_seconds(cpu_pid) if cpu_pid else 0.0
    start = time.perf_counter()
    streams = [[] for _ in prompts]
    threads = [threading.Thread(target=stream_generate, args=(server.url, p, new_tokens, start, out))
               for p, out in zip(prompts, streams)]
    for t in threads:
        t.start()
    while not all(streams) and any(t.is_alive() for t in threads):  # until every first token
        time.sleep(0.02)
    prefill_cpu = cpu_seconds(cpu_pid) - cpu_start if cpu_pid else None
    for t in threads:
        t.join()
    if any(not s or s[-1][1] != new_tokens for s in streams):
        raise RuntimeError(f"a request did not stream {new_tokens} tokens: {[s[-1:] for s in streams]}")
    all_decoding = max(s[0][0] for s in streams)  # every request has its first token
    per_token = [(t1 - t0) / (n1 - n0) for s in streams for (t0, n0), (t1, n1) in zip(s, s[1:])
                 if t0 >= all_decoding and n1 > n0]
    if warm_up:  # only the server's first-call costs matter; a loaded machine may stream fewer chunks
        return None
    if len(per_token) < batch * 8:
        raise RuntimeError(f"too few decode steps with the whole batch running ({len(per_token)}); raise --new-tokens")
    step = statistics.median(per_token)
    return {"context": context, "batch": batch, "decode_tokens_per_s": round(batch / step, 2),
            "ms_per_decode_step": round(1000 * step, 2),
            "ms_per_decode_step_mean": round(1000 * statistics.fmean(per_token), 2),
            "decode_intervals": len(per_token), "prefill_s": round(all_decoding, 2),
            **({"prefill_cpu_s": round(prefill_cpu, 2)} if cpu_pid else {})}


def scheduler_pid(server) -> int:
    """The pid of the server's scheduler process, which runs the model (a child of the launcher)."""
    listing = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(server.proc.pid)], capture_output=True,
                             text=True, check=True).stdout
    for line in listing.splitlines():
        pid, _, args = line.strip().partition(" ")
        if "scheduler" in args:
            return int(pid)
    raise RuntimeError(f"no scheduler process under the server's pid {server.proc.pid}:\n{listing}")


def extend_profile(raw_path: str, top: int = 10) -> list[list]:
    """[function (file), share of the extend's samples] for the functions under ``forward_extend``
    in py-spy's raw stacks (``frame;frame;... count`` per line), most samples first (a function
    counts once per stack), then the extend's samples and those of the whole run (decode too)."""
    calls, total, busy = {}, 0, 0
    with open(raw_path) as f:
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            busy += int(count)
            frames = stack.split(";")
            # frames read "Class.method (file.py:line)"
            below = [i for i, frame in enumerate(frames) if frame.partition(" (")[0].split(".")[-1] == "forward_extend"]
            if not below:
                continue
            total += int(count)
            names = set()
            for frame in frames[below[0]:]:
                name, _, where = frame.partition(" (")
                names.add(f"{name} ({'/'.join(where.split(':')[0].split('/')[-2:])})")
            for name in names:
                calls[name] = calls.get(name, 0) + int(count)
    ranked = sorted(calls.items(), key=lambda kv: -kv[1])[:top]
    return [[name, round(n / max(1, total), 3)] for name, n in ranked] + [["samples", total], ["all samples", busy]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 32768, 65536])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP_NUM_THREADS of the servers (torch intra-op threads; default: all cores)")
    ap.add_argument("--backends", nargs="+", default=["torch_native", "nosa"])
    ap.add_argument("--tp-sizes", type=int, nargs="+", default=[1],
                    help="tensor-parallel sizes to run side by side (--tp-size of each server)")
    ap.add_argument("--evict-scale", type=float, default=0.0,
                    help="> 0: a NOSA checkpoint with random eviction heads of this scale (default: dense, A = 0)")
    ap.add_argument("--quick", action="store_true", help="contexts 4K and 8K, 32 new tokens")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "serve.json"))
    ap.add_argument("--py-spy", metavar="DIR", default=None,
                    help="sample the server's scheduler with py-spy while each context runs (see above)")
    args = ap.parse_args()
    # A plain kill must still stop the server (its process group) through the finally below.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.contexts, args.new_tokens = [4096, 8192], 32

    from nosa.config import NosaConfig
    from nosa.serve.tools.process import ServerProcess, cpu_binding

    work = tempfile.mkdtemp(prefix="nosa_bench_")
    ckpt = os.path.join(work, "tiny-llama")
    build_model(ckpt, args.evict_scale)
    max_ctx = max(args.contexts) + args.new_tokens + 16
    flags = ["--skip-server-warmup", "--dtype", "float32", "--chunked-prefill-size", "-1",
             "--mem-fraction-static", "0.3", "--context-length", str(max_ctx),
             "--max-total-tokens", str(args.batch * max_ctx + 1024),
             "--max-running-requests", str(args.batch)]
    # py-spy as installed beside this Python (a venv's bin), else on PATH
    py_spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy") or "py-spy"
    results = []
    for backend in args.backends:
        for tp in args.tp_sizes:
            env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
            if tp > 1:
                env["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_binding(tp)
            server = ServerProcess(ckpt, ["--attention-backend", backend, "--tp-size", str(tp), *flags],
                                   os.path.join(work, f"{backend}_tp{tp}.log"), env=env).wait_ready()
            try:
                measure(server, 512, args.batch, 16, warm_up=True)  # first-call costs of a fresh server
                for context in args.contexts:
                    spy = None
                    if args.py_spy:
                        os.makedirs(args.py_spy, exist_ok=True)
                        raw = os.path.join(args.py_spy, f"{backend}_tp{tp}_{context}.txt")
                        # --nonblocking: samples without pausing the server, so the timings stand
                        spy = subprocess.Popen([py_spy, "record", "--pid", str(scheduler_pid(server)), "--rate",
                                                "50", "--nonblocking", "--format", "raw", "-o", raw],
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    try:
                        row = {"backend": backend, "tp_size": tp,
                               **measure(server, context, args.batch, args.new_tokens, cpu_pid=scheduler_pid(server))}
                    finally:
                        if spy is not None:
                            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
                            spy.wait(timeout=120)
                    if spy is not None:
                        row["extend_profile"] = extend_profile(raw)
                    print(json.dumps(row), flush=True)
                    results.append(row)
            finally:
                server.stop()
    speedup, tp_speedup = {}, {}
    for context in args.contexts:
        by = {r["backend"]: r for r in results if r["context"] == context and r["tp_size"] == args.tp_sizes[0]}
        if "nosa" in by and "torch_native" in by:
            ratio = by["torch_native"]["ms_per_decode_step"] / by["nosa"]["ms_per_decode_step"]
            speedup[str(context)] = round(ratio, 2)
        for backend in args.backends:
            by_tp = {r["tp_size"]: r for r in results if r["context"] == context and r["backend"] == backend}
            for tp in args.tp_sizes[1:]:  # decode step of the first size over each other size's
                ratio = by_tp[args.tp_sizes[0]]["ms_per_decode_step"] / by_tp[tp]["ms_per_decode_step"]
                tp_speedup[f"{backend} {context} tp{tp}"] = round(ratio, 2)
    report = {"model": "llama 2 layers, hidden 256, GQA 8/2, fp32, random weights",
              "nosa_config": NosaConfig().to_dict(), "evict_scale": args.evict_scale, "device": "cpu",
              "cpus": os.cpu_count(), "threads": args.threads, "command": " ".join(sys.argv),
              "results": results, "decode_speedup_nosa_over_torch_native": speedup,
              f"decode_speedup_over_tp{args.tp_sizes[0]}": tp_speedup}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps({"nosa_over_torch_native": speedup, f"over_tp{args.tp_sizes[0]}": tp_speedup}))


if __name__ == "__main__":
    main()
