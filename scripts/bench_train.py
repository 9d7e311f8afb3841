"""Training step time, dense vs NOSA, side by side in one run.

    .venv/bin/python scripts/bench_train.py --threads 1 [--quick] [--crossover] [--config configs/train/tiny.yaml]
        [--out results/train.json] [key=value overrides of the training config, e.g. seq_len=1024]

Builds the model of the training config (``model.build``, random weights, vocabulary of
``tokenizer.vocab_size``), then times full optimizer steps (forward + backward + AdamW step on
``micro_batch`` rows of ``seq_len`` random tokens) of the dense model and of the same weights
converted to NOSA with the config's ``nosa`` section and eviction heads switched on (A != 0, so
the selection is what a fine-tuned model's would be). Each variant gets warm-up steps, then the
median of the timed steps is reported; the variants alternate step by step so machine noise hits
both alike. Also times the NOSA forward alone (``--prefill-context``, default 32K, released
NosaConfig) on one layer's shapes, the extend path SGLang runs, against dense causal SDPA.
``--crossover`` times the two CPU paths of the selected-block attention (gathered, masked)
against each other over context lengths, the measurements behind nosa.attention.masked's
thresholds. Not a test: nothing is asserted.

On a GPU (``--device cuda``, the default where one is), the steps run in bf16 autocast over float32
weights, timed to the end of the GPU's work, and ``--like smollm2-135m`` builds random weights of a
real checkpoint's shape, so that the fine-tune's step time is measured without its weights:

    python scripts/bench_train.py --config configs/train/smollm2-sparse.yaml --like smollm2-135m \
        --seq-lens 2048 8192 --prefill-context 0 --out results/gpu/train_gpu.json   # gpu_check.sh
"""

from __future__ import annotations

import argparse
import os

import torch

from nosa.bench.train_speed import SHAPES, run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "train", "tiny.yaml"))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per variant (default 6)")
    ap.add_argument("--evict-scale", type=float, default=0.5, help="A of the NOSA variant's eviction heads")
    ap.add_argument("--prefill-context", type=int, default=32768, help="0 to skip the prefill timing")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch intra-op threads (default: torch's choice; 1 gives stable figures on a shared machine)")
    ap.add_argument("--crossover", action="store_true",
                    help="also time attend_selected's gathered vs masked CPU paths on one layer: training "
                         "(the config's nosa, 1-8x its seq_len) and prefill (released NosaConfig, 5K-16K): the "
                         "measurements behind nosa.attention.masked's thresholds (about 5 minutes)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the steps run (cuda: bf16 autocast over float32 weights)")
    ap.add_argument("--like", choices=sorted(SHAPES), default=None,
                    help="random weights of this checkpoint's shape instead of the config's model")
    ap.add_argument("--seq-lens", type=int, nargs="+", default=None,
                    help="time each of these row lengths (default: the config's seq_len)")
    ap.add_argument("--quick", action="store_true", help="1 warm-up and 3 timed steps, prefill at 8K")
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "train.json"))
    ap.add_argument("overrides", nargs="*", help="key=value overrides of the training config")
    args = ap.parse_args()
    if args.quick:
        args.warmup, args.steps = 1, 3
        args.prefill_context = min(args.prefill_context, 8192)
    run(args)


if __name__ == "__main__":
    main()
