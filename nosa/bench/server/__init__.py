"""A local SGLang server for the benchmarks and the serving tests: ``process`` (start, stop, pause),
``measure`` (streamed decode timing, CPU time, py-spy), ``stats`` (its stats file's counters and
timeline), ``dashboard`` (the timeline summed up and plotted)."""
