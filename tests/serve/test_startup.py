"""nosa.serve.startup: a malformed NosaConfig, and offloading settings that cannot work, stop SGLang's
server-argument resolution (the launcher, before any scheduler starts) with the backend's own message;
settings that work, and servers without offloading, resolve as before. Run in-process through
SGLang's real resolution."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("sglang")
import nosa  # noqa: E402
from nosa.bench import tiny_checkpoint as tiny  # noqa: E402
from nosa.serve import plugin  # noqa: E402

CFG = nosa.NosaConfig.tiny(dense_len=64)  # block_size 16, a budget of 128 tokens
OFFLOAD = {"NOSA_OFFLOAD": "1", "NOSA_HOST_KV_TOKENS": "3000", "NOSA_DEVICE_KV_TOKENS": "512"}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("startup")
    return {"llama": tiny.make_checkpoint(str(root / "llama"), CFG, seed=0),
            "hybrid": tiny.make_checkpoint(str(root / "gemma"), CFG, seed=0, model_type="gemma3_text", window=64)}


def resolve(path: str, **kwargs) -> None:
    from sglang.srt.server_args import ServerArgs

    plugin.register()
    ServerArgs(model_path=path, device="cpu", attention_backend="nosa", **kwargs).resolve_once()


@pytest.mark.parametrize("model, kwargs, error", [
    ("llama", {"page_size": 1}, "--page-size must equal NosaConfig.block_size=16 (got --page-size 1)"),
    ("hybrid", {"page_size": 16}, "offloading a hybrid model (sliding-window layers) needs --disable-radix-cache"),
    ("llama", {"page_size": 16}, None),
    ("hybrid", {"page_size": 16, "disable_radix_cache": True}, None),
])
def test_offloading_settings_are_checked_before_a_scheduler_starts(ckpts, monkeypatch, model, kwargs, error):
    for name, value in OFFLOAD.items():
        monkeypatch.setenv(name, value)
    if error is None:
        resolve(ckpts[model], **kwargs)
    else:
        with pytest.raises(ValueError, match=error.replace("(", r"\(").replace(")", r"\)")):
            resolve(ckpts[model], **kwargs)


def test_without_offloading_only_the_nosa_config_is_checked(ckpts, monkeypatch, tmp_path):
    monkeypatch.delenv("NOSA_OFFLOAD", raising=False)
    resolve(ckpts["llama"], page_size=1)
    resolve(ckpts["hybrid"], page_size=16)
    # a 'nosa' section whose budget cannot hold the forced blocks: the launcher stops, naming it
    bad = tmp_path / "bad"
    bad.mkdir()
    with open(f"{ckpts['llama']}/config.json") as f:
        config = json.load(f)
    config["nosa"]["topk_blocks"] = 2
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"malformed 'nosa' section in {bad}/config.json .*topk_blocks=2"):
        resolve(str(bad))
    # a dense checkpoint takes its NosaConfig from $NOSA_CONFIG, checked the same way
    dense = tmp_path / "dense"
    dense.mkdir()
    del config["nosa"]
    config["model_type"], config["architectures"] = "llama", ["LlamaForCausalLM"]
    (dense / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("NOSA_CONFIG", "{not json")
    with pytest.raises(ValueError, match=r"malformed \$NOSA_CONFIG"):
        resolve(str(dense))
