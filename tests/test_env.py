"""The settings registry (nosa.env): every NOSA_* variable the code names is registered, every
registered one is read, the converted folders read them only through the registry's readers, and
the readers' errors name the variable."""

import ast
import re
from pathlib import Path

import pytest

from nosa import env

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("nosa", "kernels", "train", "serve", "scripts")  # every NOSA_* name here must be registered
# Folders (or files) whose Python reads its variables through nosa.env only
CONVERTED = ("nosa", "kernels", "train", "serve", "scripts", "tests/real")
READERS = {"flag", "integer", "choice", "text", "path"}
NAME = re.compile(r"(?<![A-Za-z0-9_])NOSA_[A-Z_]*[A-Z]")


def files(*folders: str):
    for folder in folders:
        base = ROOT / folder
        paths = [base] if base.is_file() else sorted(base.rglob("*"))
        yield from (p for p in paths if p.is_file() and p.suffix in (".py", ".sh") and "__pycache__" not in p.parts)


def string_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level NAME = "text" assignments (e.g. ENV_CONFIG = "NOSA_CONFIG")."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out.update({t.id: node.value.value for t in node.targets if isinstance(t, ast.Name)})
    return out


def key_of(node: ast.AST, constants: dict[str, str]) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    return None


def registry_reads(path: Path) -> set[str]:
    """Names read through nosa.env's readers in a Python file: env.flag("NOSA_X"), env.text(ENV_X) ..."""
    tree = ast.parse(path.read_text())
    constants = string_constants(tree)
    out = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in READERS
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "env" and node.args):
            key = key_of(node.args[0], constants)
            if key:
                out.add(key)
    return out


def bare_reads(path: Path) -> list[str]:
    """os.environ.get / os.environ[...] / os.getenv of a NOSA_* name in a Python file."""
    tree = ast.parse(path.read_text())
    constants = string_constants(tree)
    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            target = ast.unparse(node.func)
            if target in ("os.environ.get", "os.getenv", "environ.get"):
                key = key_of(node.args[0], constants)
        elif isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ"):
            if isinstance(node.ctx, ast.Load):
                key = key_of(node.slice, constants)
        if key and key.startswith("NOSA_"):
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_every_named_variable_is_registered():
    registered = {var.name for var in env.VARIABLES}
    unknown = sorted({f"{name} ({path.relative_to(ROOT)})" for path in files(*SCANNED)
                      for name in NAME.findall(path.read_text()) if name not in registered})
    assert not unknown, "not in nosa.env.VARIABLES: " + ", ".join(unknown)


def test_every_registered_variable_is_read_by_its_files():
    names = [var.name for var in env.VARIABLES]
    assert len(names) == len(set(names))
    missing = []
    for var in env.VARIABLES:
        assert var.name.startswith("NOSA_") and var.meaning and var.used_by, var
        assert var.default is None or isinstance(var.default, str), var
        assert not var.choices or var.default is None or var.default in var.choices, var
        for used in var.used_by:
            path = ROOT / used
            if not path.is_file():
                missing.append(f"{var.name}: {used} does not exist")
            elif path.suffix == ".py" and any(used == c or used.startswith(c + "/") for c in CONVERTED):
                if var.name not in registry_reads(path):
                    missing.append(f"{var.name}: {used} does not read it through nosa.env")
            elif var.name not in path.read_text():
                missing.append(f"{var.name}: {used} does not name it")
    assert not missing, "\n".join(missing)


def test_converted_folders_read_no_variable_bare():
    found = [line for path in files(*CONVERTED) if path.suffix == ".py" and path.name != "env.py"
             for line in bare_reads(path)]
    assert not found, "read these through nosa.env:\n" + "\n".join(found)


def test_readers_defaults(monkeypatch):
    for name in ("NOSA_KERNELS", "NOSA_DEBUG_CHECKS", "NOSA_RECALL_CHUNK_ITEMS", "NOSA_CONFIG", "NOSA_KERNEL_CACHE",
                 "NOSA_HOST_KV_TOKENS"):
        monkeypatch.delenv(name, raising=False)
    assert env.choice("NOSA_KERNELS") == "auto"
    assert env.flag("NOSA_DEBUG_CHECKS") is False
    assert env.integer("NOSA_RECALL_CHUNK_ITEMS", minimum=1) == 64
    assert env.integer("NOSA_HOST_KV_TOKENS", minimum=1) is None
    assert env.text("NOSA_CONFIG") is None
    assert env.path("NOSA_KERNEL_CACHE") == Path.home() / ".cache" / "nosa" / "kernels"
    monkeypatch.setenv("NOSA_KERNELS", "")  # empty reads as unset
    assert env.choice("NOSA_KERNELS") == "auto"


def test_readers_values(monkeypatch, tmp_path):
    monkeypatch.setenv("NOSA_KERNELS", " Reference ")
    assert env.choice("NOSA_KERNELS") == "reference"
    for value, expected in (("1", True), ("on", True), ("TRUE", True), ("0", False), ("off", False)):
        monkeypatch.setenv("NOSA_DEBUG_CHECKS", value)
        assert env.flag("NOSA_DEBUG_CHECKS") is expected
    monkeypatch.setenv("NOSA_RECALL_CHUNK_ITEMS", " 8 ")
    assert env.integer("NOSA_RECALL_CHUNK_ITEMS", minimum=1) == 8
    monkeypatch.setenv("NOSA_KERNEL_CACHE", str(tmp_path))
    assert env.path("NOSA_KERNEL_CACHE") == tmp_path
    monkeypatch.setenv("NOSA_CONFIG", '{"topk_blocks": 4}')
    assert env.text("NOSA_CONFIG") == '{"topk_blocks": 4}'


def test_readers_errors_name_the_variable(monkeypatch):
    monkeypatch.setenv("NOSA_KERNELS", "fast")
    with pytest.raises(ValueError, match=r"NOSA_KERNELS must be one of \('auto', 'reference', 'triton'\), got 'fast'"):
        env.choice("NOSA_KERNELS")
    monkeypatch.setenv("NOSA_DEBUG_CHECKS", "2")
    with pytest.raises(ValueError, match=r"\$NOSA_DEBUG_CHECKS='2' must be 1 \(on\) or 0 \(off\)"):
        env.flag("NOSA_DEBUG_CHECKS")
    monkeypatch.setenv("NOSA_RECALL_CHUNK_ITEMS", "many")
    with pytest.raises(ValueError, match=r"\$NOSA_RECALL_CHUNK_ITEMS='many' is not an integer"):
        env.integer("NOSA_RECALL_CHUNK_ITEMS")
    monkeypatch.setenv("NOSA_RECALL_CHUNK_ITEMS", "0")
    with pytest.raises(ValueError, match=r"\$NOSA_RECALL_CHUNK_ITEMS=0 must be >= 1"):
        env.integer("NOSA_RECALL_CHUNK_ITEMS", minimum=1)
    with pytest.raises(KeyError, match="NOSA_NOT_A_SETTING is not a registered"):
        env.text("NOSA_NOT_A_SETTING")
