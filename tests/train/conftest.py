import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SMOKE = os.path.join(REPO, "configs", "train", "smoke.yaml")

pytest.importorskip("deepspeed")
pytest.importorskip("datasets")


@pytest.fixture(autouse=True)
def _repo_cwd(monkeypatch):
    """Config paths (configs/deepspeed/...) are relative to the repository root."""
    monkeypatch.chdir(REPO)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")


@pytest.fixture
def smoke_overrides():
    """f(tmp, **extra) -> overrides that keep a smoke run inside ``tmp`` (data and run dir)."""

    def make(tmp, **extra):
        items = {"out_dir": os.path.join(tmp, "run"), "data.synthetic.dir": os.path.join(tmp, "data")}
        items.update(extra)
        return [f"{k}={v}" for k, v in items.items()]

    return make
