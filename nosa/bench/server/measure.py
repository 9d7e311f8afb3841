"""Measuring one batch of streamed greedy requests on a running SGLang server (scripts/bench_serve.py,
scripts/bench_offload.py): decode step time from the streamed tokens, prefill time, and the server's
scheduler process's CPU time and page faults from /proc, optionally under py-spy."""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

import torch


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


def _proc_stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rpartition(")")[2].split()  # the fields after the command name, which may hold spaces


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    fields = _proc_stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def minor_faults(pid: int) -> int:
    """Minor page faults of process ``pid`` so far: first touches of memory the process had not used
    yet or had given back to the kernel (each costs a kernel entry and a zeroed page)."""
    return int(_proc_stat(pid)[7])


def random_prompts(context: int, batch: int, vocab: int = 256) -> list[list[int]]:
    """``batch`` prompts of ``context`` random token ids below ``vocab`` (seeded by ``context``)."""
    g = torch.Generator().manual_seed(context)
    return [torch.randint(0, vocab, (context,), generator=g).tolist() for _ in range(batch)]


def measure(server, prompts: list[list[int]], new_tokens: int, warm_up: bool = False,
            cpu_pid: int | None = None, flush: bool = True) -> dict | None:
    """One batch of concurrent greedy requests, one per prompt, streamed; None with ``warm_up``.

    Prefill: until every request has its first token (``prefill_s``; with ``cpu_pid``, the server's
    scheduler process, also its CPU seconds then, ``prefill_cpu_s``, less sensitive than wall time
    to other load). Decode: the intervals between streamed tokens once the whole batch decodes, per
    token; their median is the step time (robust to a noisy machine), their mean is reported too,
    and ``ms_per_decode_step_window`` is the median over requests of each one's mean step over its
    window (robust to a stream delivered in bursts). With ``cpu_pid`` also the scheduler's CPU ms
    (``cpu_ms_per_decode_step``, over the ``new_tokens - 1`` steps after the last first token) and
    minor page faults (``minor_faults_per_decode_step``) per decode step. The prefix cache is
    flushed first (``flush=False`` keeps it: a prompt served before is then a cache hit, and
    ``prefill_s`` the time to rebuild the request's state from the cached KV)."""
    if flush:
        server.post("/flush_cache", {})
    batch = len(prompts)
    cpu_start = cpu_seconds(cpu_pid) if cpu_pid else 0.0
    start = time.perf_counter()
    streams = [[] for _ in prompts]
    threads = [threading.Thread(target=stream_generate, args=(server.url, p, new_tokens, start, out))
               for p, out in zip(prompts, streams)]
    for t in threads:
        t.start()
    while not all(streams) and any(t.is_alive() for t in threads):  # until every first token
        time.sleep(0.02)
    decode_cpu_start = cpu_seconds(cpu_pid) if cpu_pid else 0.0
    faults_start = minor_faults(cpu_pid) if cpu_pid else 0
    prefill_cpu = decode_cpu_start - cpu_start if cpu_pid else None
    for t in threads:
        t.join()
    decode_cpu = cpu_seconds(cpu_pid) - decode_cpu_start if cpu_pid else None
    decode_faults = minor_faults(cpu_pid) - faults_start if cpu_pid else None
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
    # each stream's mean step over its whole window (last token minus its first token after every
    # request decodes): unlike the median interval, not fooled when a loaded machine delivers the
    # stream in bursts (many near-zero intervals, then a long one)
    windows = []
    for s in streams:
        inside = [(t, n) for t, n in s if t >= all_decoding]
        if len(inside) > 1 and inside[-1][1] > inside[0][1]:
            windows.append((inside[-1][0] - inside[0][0]) / (inside[-1][1] - inside[0][1]))
    return {"prompt_tokens": max(len(p) for p in prompts), "batch": batch,
            "decode_tokens_per_s": round(batch / step, 2),
            "ms_per_decode_step": round(1000 * step, 2),
            "ms_per_decode_step_mean": round(1000 * statistics.fmean(per_token), 2),
            "ms_per_decode_step_window": round(1000 * statistics.median(windows), 2) if windows else None,
            "decode_intervals": len(per_token), "prefill_s": round(all_decoding, 2),
            **({"prefill_cpu_s": round(prefill_cpu, 2),
                # every request decodes new_tokens - 1 steps after its first token, the batch together
                "cpu_ms_per_decode_step": round(1000 * decode_cpu / max(1, new_tokens - 1), 2),
                "minor_faults_per_decode_step": round(decode_faults / max(1, new_tokens - 1), 1)} if cpu_pid else {})}


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


def profiled_measure(server, prompts: list[list[int]], new_tokens: int, spy_path: str | None,
                     flush: bool = True) -> dict:
    """``measure`` with the scheduler's CPU seconds; with ``spy_path``, py-spy samples the scheduler
    meanwhile (raw stacks to that file) and the row gets ``extend_profile``."""
    pid = scheduler_pid(server)
    if spy_path is None:
        return measure(server, prompts, new_tokens, cpu_pid=pid, flush=flush)
    os.makedirs(os.path.dirname(spy_path), exist_ok=True)
    # py-spy as installed beside this Python (a venv's bin), else on PATH
    py_spy = shutil.which("py-spy", path=os.path.dirname(sys.executable)) or shutil.which("py-spy") or "py-spy"
    # --nonblocking: samples without pausing the server, so the timings stand
    spy = subprocess.Popen([py_spy, "record", "--pid", str(pid), "--rate", "50", "--nonblocking", "--format", "raw",
                            "-o", spy_path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        row = measure(server, prompts, new_tokens, cpu_pid=pid, flush=flush)
    finally:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        spy.wait(timeout=120)
    return {**row, "extend_profile": extend_profile(spy_path)}
