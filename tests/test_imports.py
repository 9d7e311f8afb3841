"""How the modules import each other: no import loop in nosa/ and kernels/, no private name crossing
a file, the shared attention math importable without the kernels, kernels/ reaching nosa/ only
through its ground floor, and every import inside a function saying why it is there."""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Folders whose function-level imports must say why (nosa/ includes nosa/bench/)
LOCAL_IMPORT_FOLDERS = ("nosa", "kernels", "train", "serve")
REASON = re.compile(r"#\s*(optional|cycle):\s*\S")
# repository folder -> the package it is imported as (nosa/__init__.py attaches the others)
PACKAGES = {"nosa": "nosa", "kernels": "nosa.kernels", "train": "nosa.train", "serve": "nosa.serve"}


def module_name(path: Path) -> str:
    """nosa/attention/math.py -> nosa.attention.math; kernels/recall.py -> nosa.kernels.recall."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGES[parts[0]], *parts[1:]])


def project_modules(*folders: str) -> dict[str, Path]:
    return {module_name(p): p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))}


def imports(path: Path):
    """(imported module, imported name or None) for every import in the file, function bodies
    included (a lazy import still makes a loop)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            for alias in node.names:
                yield node.module, alias.name


def test_no_import_loop_in_nosa_and_kernels():
    """E.g. attention -> ops -> kernels -> attention: the kernels' references import the shared math
    (nosa.attention.math), never the prefill entry points that dispatch to the kernels."""
    modules = project_modules("nosa", "kernels")
    edges = {}
    for name, path in modules.items():
        targets = set()
        for module, item in imports(path):
            if item is not None and f"{module}.{item}" in modules:
                targets.add(f"{module}.{item}")  # from nosa.attention import gathered
            elif module in modules and module != "nosa":  # the package __init__ attaches, it is no step
                targets.add(module)
        edges[name] = targets - {name}
    state = {}  # module -> "open" while on the path being walked, "done" after

    def walk(name, path):
        state[name] = "open"
        for target in sorted(edges[name]):
            assert state.get(target) != "open", "import loop: " + " -> ".join(path + [target])
            if target not in state:
                walk(target, path + [target])
        state[name] = "done"

    for name in sorted(edges):
        if name not in state:
            walk(name, [name])


def test_no_private_name_crosses_a_file():
    offenders = []
    for folder in ("nosa", "kernels", "train", "serve", "tests", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for module, item in imports(path):
                ours = module.split(".")[0] == "nosa"
                if ours and item and item.startswith("_") and not item.startswith("__"):
                    offenders.append(f"{path.relative_to(ROOT)}: from {module} import {item}")
    assert not offenders, "\n".join(offenders)


def test_attention_math_imports_no_kernel_code():
    code = ("import sys, nosa.attention.math; "
            "print(sorted(m for m in sys.modules if m == 'nosa.ops' or m.startswith('nosa.kernels.')))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def imported_modules(path: Path) -> set[str]:
    """Every module a file imports (function bodies included); ``from nosa import env`` -> nosa.env."""
    out = set()
    for module, item in imports(path):
        out.add(f"{module}.{item}" if module == "nosa" and item else module)
    return out


GROUND_FLOOR = ("nosa.layout", "nosa.env", "nosa.kvquant")  # modules that import nothing of nosa


def test_kernels_import_only_the_ground_floor_of_nosa():
    """kernels/ reaches nosa/ only through its ground floor (nosa.layout, nosa.env, nosa.kvquant): nosa.ops is the
    one place nosa/ reaches the kernels, so no loop can form through them."""
    offenders = []
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        for module in sorted(imported_modules(path)):
            ours = module == "nosa" or module.startswith("nosa.")
            if ours and module not in GROUND_FLOOR and not module.startswith("nosa.kernels."):
                offenders.append(f"{path.relative_to(ROOT)}: imports {module}")
    assert not offenders, "\n".join(offenders)


def test_ground_floor_imports_nothing_of_nosa():
    allowed = {"layout.py": {"__future__", "torch"}, "env.py": set(sys.stdlib_module_names),
               "kvquant.py": {"__future__", "torch", "typing"}}
    for name, modules in allowed.items():
        tops = {module.split(".")[0] for module in imported_modules(ROOT / "nosa" / name)}
        assert tops <= modules, f"nosa/{name} imports {sorted(tops - modules)}"


def test_every_import_inside_a_function_says_why():
    """An import inside a function carries ``# optional: ...`` (a dependency not every install has,
    or one that must not load at import time) or ``# cycle: ...`` (the import loop it avoids) on its
    first line; everything else is imported at the top of the module."""
    offenders = []
    for folder in LOCAL_IMPORT_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            lines = path.read_text().splitlines()
            for node in ast.walk(ast.parse("\n".join(lines))):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for inner in ast.walk(node):
                    if isinstance(inner, (ast.Import, ast.ImportFrom)) and not REASON.search(lines[inner.lineno - 1]):
                        offenders.append(f"{path.relative_to(ROOT)}:{inner.lineno}: {lines[inner.lineno - 1].strip()}")
    assert not offenders, "imports inside functions without '# optional:' or '# cycle:':\n" + "\n".join(
        sorted(set(offenders)))


def test_serving_code_imports_nothing_of_train_or_bench():
    """serve/ (the SGLang backend) runs without the training code and the benchmark library: no
    import of nosa.train or nosa.bench in it, function bodies included (a lazy import is still a
    dependency). The benchmark library and the tests may import serve/, not the other way round."""
    offenders = []
    for path in sorted((ROOT / "serve").rglob("*.py")):
        for module, item in imports(path):
            name = f"{module}.{item}" if item else module  # from nosa import train -> nosa.train
            if any(name == banned or name.startswith(banned + ".") for banned in ("nosa.train", "nosa.bench")):
                offenders.append(f"{path.relative_to(ROOT)}: imports {name}")
    assert not offenders, "\n".join(offenders)


def test_the_training_entry_point_imports_no_hub_package():
    """python -m nosa.train sets the offline environment (HF_HUB_OFFLINE ...) before transformers,
    datasets and deepspeed are imported, which read it once, at import: importing the entry point
    and the run must not import them (their imports inside functions say so)."""
    code = ("import sys, nosa.train.__main__, nosa.train.loop; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'transformers', 'datasets', 'huggingface_hub', 'deepspeed', 'wandb'}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
