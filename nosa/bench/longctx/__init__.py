"""The long-context suite (scripts/bench_longctx.py) and what runs on its examples: ``config`` (the
suite's NosaConfig), ``variant`` (one variant on one example), ``run`` (every variant on every
example), ``summary`` (the report, merged, tabled and plotted), ``chat`` (its prompts as chat
requests to a server), ``coverage``, ``sweep`` and ``probe`` (the eviction heads' fit and ranking)."""
