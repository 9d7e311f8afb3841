"""Decode throughput of SGLang's "nosa" backend vs "torch_native" on the same tiny model.

    .venv/bin/python scripts/bench_serve.py [--quick] [--contexts 4096 8192 32768 65536] [--out results/serve.json]
    .venv/bin/python scripts/bench_serve.py --backends torch_native nosa nosa+compile --contexts 4096 32768
    .venv/bin/python scripts/bench_serve.py --checkpoint runs/tiny/nosa --backends nosa nosa+offload --contexts 2048
    .venv/bin/python scripts/bench_serve.py --checkpoint runs/tiny/nosa --backends nosa nosa+offload --contexts 2048 \
        --repeat 3                                                 # 3 rounds of fresh servers: median ratios
    .venv/bin/python scripts/bench_serve.py --checkpoint runs/tiny/nosa --backends nosa nosa+offload --contexts 2048 \
        --interleave --repeat 10                     # both servers up, paused in turn: 10 paired rounds
    .venv/bin/python scripts/bench_serve.py --backends nosa --tp-sizes 1 2 --evict-scale 1 --contexts 32768
    .venv/bin/python scripts/bench_serve.py --checkpoint runs/smollm2/nosa --compare a0=runs/smollm2-a0/nosa \
        --prompts suite --share 4 --contexts 8192 --batch 1 --new-tokens 16 --threads 1 \
        --backends torch_native nosa nosa+offload+sched            # the real model at 8K

Builds a tiny random Llama (2 layers, hidden 256, GQA 8/2; a dense checkpoint, so the backend uses
the released NosaConfig defaults: 64 blocks of 64 tokens, dense_len 4096), then for each variant
(and tensor-parallel size, ``--tp-sizes``) starts one server (stopped before the next starts: an
idle server keeps a core busy) and, for each context length, sends ``--batch`` concurrent greedy
requests with streaming (see ``nosa.bench.server.measure.measure``: the decode step time is the median interval between
streamed tokens while the whole batch decodes, so prefill and request handling are excluded).
Contexts above the model's dense_len (4096) are where NOSA's selection applies. ``--backends``
picks variants (VARIANTS: eager or under SGLang's CPU graph runner, offloading off or on);
``--checkpoint`` serves another checkpoint (its NosaConfig; ``--share N``: the long-context
suite's NosaConfig for the longest context and 1/N of its blocks, with the checkpoint's eviction
heads). A prompt and its new tokens stay within the model's ``max_position_embeddings``, so at
SmolLM2's 8,192 an "8192" prompt is a few dozen tokens shorter (``prompt_tokens`` in each row).
``--prompts suite`` sends the long-context suite's chat prompts (nosa.train.ruler, one task per
request) instead of random token ids: what a chat model's selection and hit rate are about.
Offloading variants write the server's counters to a stats file; each row gets the decode steps'
hit rate and recalled bytes (``offload``). ``--compare LABEL=PATH`` adds checkpoints served with
the offloading variants only (fitted heads beside A = 0, say). The JSON's ``ratios`` compare the
variants per context (the ``--checkpoint``'s rows), each variant's longest context with its
shortest, and each TP size with the first. Not a test: nothing is asserted.

This machine's speed drifts: the same decode step, timed in consecutive chunks of a few seconds
inside one process, varies by 1.4-1.5x (CPU time, not waiting; scripts/bench_resolve.py's ``drift``
part), so variants measured minutes apart compare the drift as much as the code. ``--interleave``
starts every variant's server first, keeps all but the measured one paused (SIGSTOP; an idle server
polls), and gives each variant one short turn per round and context, a different one first each
round: the variants of a round ran seconds apart, and ``--repeat N`` rounds give N paired ratios
whose medians the JSON reports.

``--evict-scale A`` (A > 0) converts the model to a NOSA checkpoint with random eviction heads of
scale A, so that under tensor parallelism the ranks exchange the eviction heads' partial sums
(a dense checkpoint's A = 0 heads need no other rank). On CPU a TP server gets
SGLANG_CPU_OMP_THREADS_BIND, one share of the cores per rank (nosa.bench.server.process.cpu_binding),
and each rank runs ``--threads`` torch threads.

``--py-spy DIR`` also samples the server's scheduler process (the one running the forward passes)
with py-spy (``pip install py-spy``) while each context is measured: the raw stacks go to
``DIR/<checkpoint label>_<variant>_tp<N>_<context>_r<round>.txt`` (rank 0's scheduler under TP),
and each result row gets
``extend_profile``, the functions under the attention backend's ``forward_extend`` (prefill) with
their share of its samples.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from nosa.bench.longctx.config import PICKS, picks_share
from nosa.bench.serve_speed import VARIANTS, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[4096, 8192, 32768, 65536])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None,
                    help="OMP_NUM_THREADS of the servers (torch intra-op threads; default: all cores)")
    ap.add_argument("--backends", nargs="+", default=["torch_native", "nosa"], choices=list(VARIANTS),
                    help="variants, each its own server in turn (see VARIANTS)")
    ap.add_argument("--checkpoint", default=None,
                    help="serve this checkpoint (e.g. the quickstart's runs/tiny/nosa), not the tiny random Llama")
    ap.add_argument("--compare", nargs="+", default=[], metavar="LABEL=PATH",
                    help="more NOSA checkpoints (e.g. A = 0 beside fitted heads), each served with the offloading "
                         "variants of --backends only: hit rates and recalled bytes side by side")
    ap.add_argument("--prompts", choices=["random", "suite"], default="random",
                    help="random token ids, or the long-context suite's chat prompts (nosa.train.ruler; a chat "
                         "model such as SmolLM2), one task per request")
    ap.add_argument("--share", type=int, default=None,
                    help="serve every checkpoint at the suite's NosaConfig for the longest context and 1/share "
                         "of its blocks (nosa.bench.longctx.config.budget_config) with its own eviction heads")
    ap.add_argument("--picks", type=picks_share, default=PICKS, metavar="FRACTION",
                    help="with --share: free query-aware picks as a share of the budget (bench_longctx.py "
                         "--picks; default the suite's 1/16, the release's 15/64)")
    ap.add_argument("--tp-sizes", type=int, nargs="+", default=[1],
                    help="tensor-parallel sizes to run side by side (--tp-size of each server)")
    ap.add_argument("--evict-scale", type=float, default=0.0,
                    help="> 0: the tiny Llama as a NOSA checkpoint with random eviction heads of this scale "
                         "(default: dense, A = 0)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="rounds: every variant measured again in each round (a fresh server each round, or with "
                         "--interleave the same servers in turns); the JSON's ratios are then medians over the "
                         "rounds, ratios_by_round each round's")
    ap.add_argument("--interleave", action="store_true",
                    help="start every variant's server first and keep all but the measured one paused (SIGSTOP); "
                         "each round measures every variant at one context after the other, so the variants "
                         "compared in a round ran seconds apart: this machine's speed drifts by up to 1.5x over "
                         "seconds within one process, and a ratio of runs minutes apart measures the drift")
    ap.add_argument("--keep-prefix-cache", action="store_true",
                    help="do not flush SGLang's prefix cache before each measurement: a prompt served before is a "
                         "cache hit (its decode state rebuilt from the cached KV), so with --interleave the rounds "
                         "after the first compare decode windows seconds apart, not a prefill apart (SmolLM2 at 8K: "
                         "2 minutes); prefill_s is then the cached prefill")
    ap.add_argument("--quick", action="store_true", help="contexts 4K and 8K, 32 new tokens")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "serve.json"))
    ap.add_argument("--py-spy", metavar="DIR", default=None,
                    help="sample the server's scheduler with py-spy while each context runs (see above)")
    args = ap.parse_args()
    if args.repeat < 1:
        ap.error(f"--repeat must be at least 1, got {args.repeat}")
    # A plain kill must still stop the server (its process group) through run's finally blocks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.quick:
        args.contexts, args.new_tokens = [4096, 8192], 32
    run(args)


if __name__ == "__main__":
    main()
