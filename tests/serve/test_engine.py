"""``sglang.Engine(..., attention_backend="nosa")``: the offline API serves the same tokens as the HF
model (long prompts, budget below the context, NOSA checkpoint with non-zero eviction heads), from
the checkpoint in the legacy format (model_type llama with a 'nosa' section, as written before the
NOSA model types): SGLang's loader takes it as the NOSA format it became. The NOSA format is served
by the session's ``nosa_server`` (tests/serve/test_sglang_backend.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("sglang")
from nosa.bench import tiny_checkpoint as tiny  # noqa: E402

_MISSING = tiny.cpu_engine_missing()
if _MISSING:
    pytest.skip(_MISSING, allow_module_level=True)

import torch  # noqa: E402

import nosa  # noqa: E402

CFG = nosa.NosaConfig.tiny(dense_len=64)


def test_engine_on_a_legacy_checkpoint_matches_hf(tmp_path, legacy_copy):
    ckpt = tiny.make_checkpoint(str(tmp_path / "nosa"), CFG, seed=3, evict_scale=1.0)
    legacy = legacy_copy(ckpt, tmp_path / "legacy")
    with open(os.path.join(legacy, "config.json")) as f:
        assert json.load(f)["model_type"] == "llama"
    prompts = [tiny.prompt_ids(n, s) for n, s in [(310, 71), (457, 12), (20, 72)]]
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    script = os.path.join(os.path.dirname(__file__), "engine_generate.py")
    done = subprocess.run([sys.executable, script, legacy, json.dumps(prompts), "10"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    served = json.loads(done.stdout.strip().splitlines()[-1])["output_ids"]
    model = nosa.from_pretrained(ckpt, torch_dtype=torch.float32).eval()
    assert served == [tiny.hf_greedy(model, p, 10) for p in prompts]
