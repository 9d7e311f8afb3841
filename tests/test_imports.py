"""How the modules import each other: no import loop in nosa/ and kernels/, no private name crossing
a file, and the shared attention math importable without the kernels."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
    scripts = {p.stem for p in (ROOT / "scripts").glob("*.py")}  # scripts import their helper scripts by name
    for folder in ("nosa", "kernels", "train", "serve", "tests", "scripts"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for module, item in imports(path):
                ours = module.split(".")[0] == "nosa" or module in scripts
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
