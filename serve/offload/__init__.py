"""The KV offloading engine of the nosa backend ($NOSA_OFFLOAD=1): the KV in host memory, the few
blocks each decode step attends to in a device block cache. Nothing is imported here. One module
per part, in the order a decode step meets them:

- ``settings``: OffloadSettings, read from the environment in every SGLang process;
- ``host_pool``: HostKVPool, SGLang's KV pool in host memory, and the hooks that install it;
- ``engine``: OffloadEngine, the parts of one backend and what they do at each step;
- ``kv``: OffloadKV, the KV view a layer reads through, and the prefetch's guess (``predicted_blocks``);
- ``block_cache``: DeviceBlockCache, the device slots, their columns (admission), prefetch and resolve;
- ``resolve``: the tensor math of a resolve (slot diff, rows, counters: the CPU kernel's spec);
- ``recall``: RecallScheduler, interruptible layer-wise copies (prefetch of the next layer);
- ``admission``: Admission, I/O-adaptive admission and extra-slot lending;
- ``stats``: StepStats, per decode step and layer counters for the stats file, W&B and the dashboard.
"""
