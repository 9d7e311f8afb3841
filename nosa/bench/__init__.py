"""The benchmark library behind scripts/ (never imported by ``import nosa``): each script holds its
help text and flags and calls in here; every result JSON goes through ``results.write_result``.

- ``results`` the one result writer; ``tiny_checkpoint``, ``decode_harness`` (tests and benchmarks);
- ``server`` a local SGLang server (``process``, ``measure``, ``stats``, ``dashboard``);
- ``longctx`` the long-context suite (bench_longctx.py, sweep_fit.py, probe_ranking.py);
- one module per benchmark: ``accuracy``, ``serve_speed``, ``offload``, ``ask`` (serve_ask.py),
  ``soak``, ``kernel_speed``, ``recall_speed``, ``train_speed``, ``resolve_speed``, ``graph_replay``
  (graph_check.py), ``wandb_run`` (wandb_report.py), ``suite_time`` (time_suite.py);
- ``report`` (+ ``report_tables``, ``report_reference``): the generated blocks of README.md and docs/.
"""

import os

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout holding nosa/
