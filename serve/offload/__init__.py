"""The KV offloading engine of the nosa backend ($NOSA_OFFLOAD=1): the KV in host memory, the few
blocks each decode step attends to in a device block cache.

One module per part, in the order a decode step meets them:

- ``settings``: OffloadSettings, read from the environment in every SGLang process;
- ``host_pool``: HostKVPool, SGLang's KV pool kept in host memory, and the hooks that install it;
- ``engine``: OffloadEngine, the parts of one backend and what they do at each step (begin,
  per-layer view, prefetch, end of step, release, counters);
- ``kv``: OffloadKV, the KV view (nosa.kv) a layer reads through, and the prefetch's guess of a
  step's selection (``predicted_blocks``);
- ``block_cache``: DeviceBlockCache, the device slots of every request and KV head, their columns
  (admission), the prefetch's placement and the host side of a resolve;
- ``resolve``: the device side of a resolve (the slot diff, the one batched recall, the
  write-through, the counters): the torch spec and the CPU kernel's call;
- ``recall``: RecallScheduler, interruptible layer-wise copies (prefetch of the next layer);
- ``admission``: Admission, I/O-adaptive admission and extra-slot lending;
- ``stats``: StepStats, per decode step and layer counters for the stats file, W&B and the dashboard.

Nothing is imported here: the backend imports what the settings turn on.
"""
