"""Our top-level folders must never shadow installed packages, and `import nosa` needs only torch."""

import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("kernels", "train", "serve")


def run(code, cwd, env_path=None):
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    if env_path:
        env["PYTHONPATH"] = str(env_path)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


def test_folders_are_not_regular_packages():
    for name in FOLDERS:
        assert not (ROOT / name / "__init__.py").exists(), f"{name}/__init__.py would shadow a PyPI '{name}'"


def test_running_from_the_repo_root_does_not_shadow_installed_packages(tmp_path):
    # Stand-ins for installed packages with our folder names (SGLang imports PyPI's `kernels`).
    for name in FOLDERS:
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("ORIGIN = 'installed'\n")
    result = run(
        """
        import kernels, train, serve
        print(kernels.ORIGIN, train.ORIGIN, serve.ORIGIN)
        import transformers  # imports fine from the repo root
        import nosa.kernels, nosa.train, nosa.serve
        print(list(nosa.kernels.__path__)[0])
        """,
        cwd=ROOT, env_path=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")
    assert lines[0] == "installed installed installed"
    assert Path(lines[1]) == ROOT / "kernels"


def test_import_nosa_needs_only_torch():
    result = run(
        """
        import sys
        import torch  # torch itself probes for triton, its own dependency
        BLOCKED = ("transformers", "safetensors", "tokenizers", "sglang", "deepspeed", "wandb", "datasets")
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in BLOCKED:
                    raise ImportError(f"blocked {name}")
        sys.meta_path.insert(0, Block())
        import nosa
        cfg = nosa.NosaConfig.tiny()
        q, k = torch.randn(40, 2, 4), torch.randn(40, 1, 4)
        out, sel = nosa.nosa_prefill(q, k, k, torch.zeros(40, 1), cfg, 0.5)
        print(tuple(out.shape), sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
        """,
        cwd="/",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(40, 2, 4) []"


def test_every_subpackage_of_nosa_is_in_the_wheel():
    """pyproject.toml lists the packages explicitly (for the folder mapping), so a new subpackage of
    nosa/ (e.g. nosa/attention) ships only when it is listed."""
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    subpackages = sorted(".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "nosa").rglob("__init__.py"))
    assert "nosa.attention" in subpackages
    assert [name for name in subpackages if name not in packages] == []
