"""The long-context suite's NosaConfig (scripts/bench_longctx.py; served by scripts/serve_ask.py --suite
and scripts/bench_serve.py --share): blocks of 32 tokens, a budget of 1/share of the context's blocks,
split into 1 sink block, a window, free query-aware picks and the blocks ranked by the eviction heads."""

from __future__ import annotations

import argparse
import re
from fractions import Fraction

from nosa.config import NosaConfig

BLOCK = 32  # tokens per block: 8K = 256 blocks
RELEASED = (64, 17, 15)  # the released NOSA budget, window and picks, in blocks
RELEASED_PICKS = Fraction(RELEASED[2], RELEASED[0])
# Default share of the budget for the free query-aware picks, chosen by measurement
# (docs/real-models.md, "Choosing the split"): on examples of another seed, 1/16 kept the fitted
# heads' accuracy at 2K and raised it at 4K against the released 15/64, with 3.3x fewer blocks
# entering per step (hit rate 98% vs 93%).
PICKS = Fraction(1, 16)
# Default compressed windows (kernel, stride) in tokens: the mean keys that score blocks for a query.
WINDOWS = (BLOCK, BLOCK // 2)


def budget_config(length: int, share: int, picks: Fraction = PICKS, windows: tuple[int, int] = WINDOWS):
    """The NosaConfig of the suite at ``length`` tokens and a budget of 1/``share`` of its blocks:
    1 sink block, a window of 17/64 of the budget (the released proportion, rounded half up; at least
    2 blocks, so compressed windows end inside it), ``picks`` of the budget as free query-aware picks
    (rounded half up), the rest ranked by the eviction heads. 8K at 1/4: 64 = 1 + 17 + 4 + 42; with
    ``picks=RELEASED_PICKS`` the released structure, 64 = 1 + 17 + 15 + 31. ``windows``: the compressed
    windows' (kernel, stride) in tokens."""
    budget = length // BLOCK // share
    window = max(2, int(budget * RELEASED[1] / RELEASED[0] + 0.5))
    return NosaConfig(block_size=BLOCK, compress_kernel=windows[0], compress_stride=windows[1], sink_blocks=1,
                      window_blocks=window, topk_blocks=budget, query_blocks=int(budget * picks + 0.5), dense_len=0)


def picks_share(text: str) -> Fraction:
    """--picks: a fraction in [0, 1) such as 1/8 or 0.125."""
    try:
        value = Fraction(text)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r} is not a fraction such as 1/8") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not in [0, 1): picks are a share of the budget")
    return value


def windows_arg(text: str) -> tuple[int, int]:
    """--windows: KERNEL/STRIDE in tokens, such as 16/16."""
    kernel, sep, stride = text.partition("/")
    try:
        value = (int(kernel), int(stride))
    except ValueError:
        value = None
    if not sep or value is None or min(value) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not KERNEL/STRIDE in tokens, such as 16/16")
    return value


def windows_name(windows: tuple[int, int]) -> str:
    """"16/16": how reports and variant names write a (kernel, stride) pair."""
    return f"{windows[0]}/{windows[1]}"


WINDOWS_TAG = re.compile(r", windows \d+/\d+")  # what windows_tag puts in a variant's name


def windows_tag(windows: tuple[int, int]) -> str:
    """What a variant's name carries for its windows: nothing for the default, ", windows 16/16" else."""
    return "" if windows == WINDOWS else f", windows {windows_name(windows)}"
