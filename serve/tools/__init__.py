"""Tools around the server, not part of the backend: ``process`` (start and stop a local SGLang
server), ``tiny_checkpoint`` (tiny Llama checkpoints and their references for tests and
benchmarks) and ``sgl_kernel_standin/`` (the pure-torch ``sgl_kernel`` CPU helpers that
scripts/install_sglang_cpu.sh puts on ``sys.path``; not a module of this package).
"""
