"""The offloading benchmark (scripts/bench_offload.py): ``servers`` (each part's server, checkpoint
variant and prompts) and ``parts`` (hit rate, capacity, decode, schedule, trace)."""
