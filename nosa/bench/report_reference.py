"""The generated references of the docs: TrainConfig's and NosaConfig's fields, the NOSA_* variables.

A dataclass field's meaning is its comment: the trailing comment on the field's line(s) and the
comment lines directly above it, read with ``tokenize`` from ``inspect.getsource`` of the class,
so the docs say what the code says. Sections (fields whose type is another dataclass of the same
module) are listed with dotted names (``optim.lr``). The variables come from ``nosa.env.VARIABLES``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
from pathlib import Path
from typing import Any, Callable

import torch

from nosa import env, kvquant, plan, plan_checks
from nosa.bench.report_tables import table
from nosa.config import NosaConfig
from nosa.train.config import TrainConfig

RENDERERS: dict[str, tuple[tuple[str, ...], Callable[[Path], str]]] = {}


def renders(fn: Callable[[Path], str]) -> Callable[[Path], str]:
    RENDERERS[fn.__name__] = ((), fn)
    return fn


def field_comments(cls: type) -> dict[str, str]:
    """{field name: its comment}: the comment lines right above the field (no blank line between)
    and the trailing comments of the field's logical line, in that order."""
    source = textwrap.dedent(inspect.getsource(cls))
    comments: dict[str, str] = {}
    above: list[str] = []  # comment-only lines waiting for the statement below them
    trailing: list[str] = []  # comments inside the current statement
    code: list[tokenize.TokenInfo] = []  # the current statement's first tokens
    body_col = None  # the column of the class body's statements
    line_has_comment = False
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        kind = tok.type
        if kind in (tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            continue
        if kind == tokenize.COMMENT:
            text = tok.string.lstrip("#").strip()
            if code:
                trailing.append(text)
            else:
                above.append(text)
                line_has_comment = True
        elif kind == tokenize.NL:
            if not code and not line_has_comment:  # a blank line ends a run of comment lines
                above = []
            line_has_comment = False
        elif kind == tokenize.NEWLINE:
            first = code[0]
            if body_col is None and first.start[1] > 0:
                body_col = first.start[1]
            if (first.type == tokenize.NAME and first.start[1] == body_col and len(code) > 1
                    and code[1].string == ":"):
                comments[first.string] = " ".join(above + trailing).strip()
            above, trailing, code = [], [], []
        elif len(code) < 2:
            code.append(tok)
    return comments


def _type_text(annotation: Any) -> str:
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", repr(annotation))
    return text.replace(" | ", " or ")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _section_class(f: dataclasses.Field, module: Any) -> type | None:
    """The dataclass of this module that the field's type names (``SyntheticSection | None``)."""
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", "")
    for name in re.findall(r"[A-Za-z_]\w*", text):
        obj = getattr(module, name, None)
        if dataclasses.is_dataclass(obj) and obj.__module__ == module.__name__:
            return obj
    return None


def _cell(value: Any) -> str:
    if value is dataclasses.MISSING:
        return "(required)"
    if dataclasses.is_dataclass(value):
        return "(section)"
    text = repr(value) if not isinstance(value, str) else f'"{value}"'
    return f"`{text}`".replace("|", "\\|")


def field_rows(cls: type, prefix: str = "", stop: tuple[type, ...] = ()) -> list[list[str]]:
    """One row per field (name, type, default, meaning), sections expanded after their own row;
    a field whose type is in ``stop`` is one row (its class has a reference of its own)."""
    module = inspect.getmodule(cls)
    meaning = field_comments(cls)
    rows = []
    for f in dataclasses.fields(cls):
        name = prefix + f.name
        default = _default(f)
        section = _section_class(f, module)
        text = meaning.get(f.name, "")
        if section is None and dataclasses.is_dataclass(default) and not isinstance(default, stop):
            section = type(default)
        if section is not None and (not text) and section.__doc__ and not section.__doc__.startswith(section.__name__):
            text = " ".join(section.__doc__.split())
        cell = f"`{type(default).__name__}()`" if isinstance(default, stop) else _cell(default)
        rows.append([f"`{name}`", _type_text(f.type), cell, _escape(text)])
        if section is not None and not issubclass(section, stop):
            rows += field_rows(section, prefix=name + ".", stop=stop)
    return rows


def _escape(text: str) -> str:
    """A comment as a table cell: no HTML tags, no column breaks."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")


@renders
def train_config(root: Path) -> str:
    rows = field_rows(TrainConfig, stop=(NosaConfig,))
    return (table(["key", "type", "default", "meaning"], rows)
            + "\n\nGenerated from the fields of `nosa.train.config.TrainConfig` and their comments; "
            "`nosa` is a [NosaConfig](algorithm.md#nosaconfig).")


@renders
def nosa_config(root: Path) -> str:
    rows = field_rows(NosaConfig)
    return (table(["field", "type", "default", "meaning"], rows)
            + "\n\nGenerated from the fields of `nosa.config.NosaConfig` and their comments.")


@renders
def env_vars(root: Path) -> str:
    rows = []
    for var in env.VARIABLES:
        used = ", ".join(var.used_by)
        default = "unset" if var.default in (None, "") else f"`{var.default}`"
        rows.append([f"`{var.name}`", default, _escape(" ".join(str(var.meaning).split())), used])
    return (table(["variable", "default", "meaning", "read by"], rows)
            + "\n\nGenerated from `nosa.env.VARIABLES`.")


@renders
def host_kv_bytes(root: Path) -> str:
    """Host bytes per (token, KV head, layer) of each NOSA_HOST_KV_DTYPE, from nosa.kvquant."""
    rows = []
    for d in (64, 128):
        full = kvquant.bytes_per_token(d, d, torch.bfloat16)
        for name, dtype in (("bfloat16 (the model's)", torch.bfloat16), ("int8", torch.int8),
                            ("float8_e4m3fn", torch.float8_e4m3fn)):
            n = kvquant.bytes_per_token(d, d, dtype)
            rows.append([d, name, n, f"{n / full:.2f}x"])
    bytes_table = table(["head dim", "host KV dtype", "bytes per token, KV head and layer (K, V, scales, cis)",
                         "vs bf16"], rows)
    # capacity: SmolLM2-135M (30 layers, 3 KV heads of 64) at 8K tokens in 16 GiB of host memory, as the
    # host pool allocates it (HostKVPool: layers x pages x KV heads x page tokens x bytes_per_token)
    layers, hkv, d, context, memory = 30, 3, 64, 8192, 16 * 2**30
    fits = []
    for name, dtype in (("bf16", torch.bfloat16), ("int8", torch.int8), ("fp8", torch.float8_e4m3fn)):
        per_request = layers * hkv * context * kvquant.bytes_per_token(d, d, dtype)
        fits.append(f"{name} {memory // per_request} ({per_request / 2**20:.0f} MiB each)")
    return (bytes_table + "\n\nSmolLM2-135M requests of 8K tokens that 16 GiB of host pool holds, computed from the "
            "pool's allocation: " + ", ".join(fits) + ".")


@renders
def plan_example(root: Path) -> str:
    """``python -m nosa.plan`` on the issue's example: under the locality bound with the data sheets,
    then on an H200 at a measured hit rate, calibrated with results/gpu_h200.json."""
    common = ["--model", "llama-3.1-8b", "--context", "131072", "--link", "pcie5", "--batch", "16"]
    runs = [common + ["--gpu", "h100"],
            common + ["--gpu", "h200", "--hit-rate", "0.97", "--calibration", "results/gpu_h200.json"]]
    out = []
    for argv in runs:
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            plan.main([str(root / a) if a.startswith("results/") else a for a in argv])
        out.append(f"```\n$ python -m nosa.plan {' '.join(argv)}\n{buffer.getvalue().rstrip()}\n```")
    return "\n\n".join(out)


@renders
def plan_published(root: Path) -> str:
    """nosa.plan's predictions beside the published figures it is checked against."""
    rows = [[r["system"], r["figure"], r["setup"],
             " / ".join(f"{m} {r['batches'][m]}" for m in r["batches"]),
             " / ".join(f"{v:,.0f}" for v in r["predicted_tokens_per_s"].values()),
             f"{r['published_ratio']:.2f}x", f"{r['predicted_ratio']:.2f}x", r["assumed"]]
            for r in plan_checks.published_points()]
    lines = [table(["system", "published", "setup modelled", "largest batch", "predicted tokens/s",
                    "published ratio", "predicted ratio", "assumed"], rows), "",
             "Not reproduced:"]
    lines += [f"- {what}: {why}." for what, why in plan_checks.NOT_REPRODUCED]
    return "\n".join(lines)
