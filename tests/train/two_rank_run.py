"""Helper for test_train_multiproc.py, run under torchrun: a smoke fine-tune on every rank, then
rank 0 writes each rank's loss and parameter digest to <tmp>/ranks.json."""

import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

from nosa.train.config import load_config
from nosa.train.loop import run

tmp, config = sys.argv[1], sys.argv[2]
cfg = load_config(config, [f"out_dir={tmp}/run", f"data.synthetic.dir={tmp}/data", *sys.argv[3:]])
result = run(cfg)
digest = hashlib.sha256()
for name, p in sorted(result["model"].named_parameters()):
    digest.update(name.encode())
    digest.update(p.detach().float().cpu().numpy().tobytes())
mine = {
    "rank": dist.get_rank(),
    "digest": digest.hexdigest(),
    "loss": result["metrics"]["train/loss"],
    "a_sum": float(sum(p.abs().sum() for n, p in result["model"].named_parameters() if "nosa_evict" in n)),
}
everyone = [None] * dist.get_world_size()
dist.all_gather_object(everyone, mine)
if dist.get_rank() == 0:
    with open(os.path.join(tmp, "ranks.json"), "w") as f:
        json.dump(everyone, f)
torch.distributed.barrier()
