"""Greedy generation through ``sglang.Engine(..., attention_backend="nosa")`` (the offline API), run
as a script by test_engine.py: SGLang's Engine starts subprocesses, so it must live under
``if __name__ == "__main__"``. Prints one JSON line: {"output_ids": [[...], ...]}."""

import json
import sys

if __name__ == "__main__":
    import sglang

    ckpt, prompts, new_tokens = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    engine = sglang.Engine(model_path=ckpt, attention_backend="nosa", device="cpu", dtype="float32",
                           context_length=1024, max_total_tokens=8192, mem_fraction_static=0.3,
                           skip_server_warmup=True, log_level="error")
    try:
        outs = engine.generate(input_ids=prompts, sampling_params={"temperature": 0.0, "max_new_tokens": new_tokens,
                                                                   "ignore_eos": True})
        print(json.dumps({"output_ids": [o["output_ids"] for o in outs]}))
    finally:
        engine.shutdown()
