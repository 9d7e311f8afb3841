"""The benchmark library: what scripts/bench_*.py and the docs renderer share."""
