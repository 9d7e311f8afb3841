"""The benchmark library behind scripts/ (never imported by ``import nosa``): each script holds its
help text and flags and calls in here; every result JSON goes through ``results.write_result``.

- ``results``: the one result writer; ``tiny_checkpoint``, ``decode_harness``: tiny checkpoints and
  the serving decode step without SGLang (tests and benchmarks);
- ``server``: a local SGLang server (``process``, ``measure``, ``stats``, ``dashboard``);
- ``longctx``: the long-context suite and what runs on its examples (bench_longctx.py,
  sweep_fit.py, probe_ranking.py);
- per benchmark: ``accuracy``, ``serve_speed`` (bench_serve.py), ``offload``, ``ask`` (serve_ask.py),
  ``soak``, ``kernel_speed``, ``recall_speed``, ``train_speed``, ``resolve_speed`` (bench_kernels.py,
  bench_recall.py, bench_train.py, bench_resolve.py), ``graph_replay`` (graph_check.py), ``wandb_run``
  (wandb_report.py);
- ``report`` (+ ``report_tables``, ``report_reference``): the generated blocks of README.md and
  docs/ (results tables from results/*.json, the config and NOSA_* references from the code).
"""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout holding nosa/
