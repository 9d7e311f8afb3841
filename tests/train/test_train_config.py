"""Bad input fails early with a clear message and writes nothing."""

import json
import os

import pytest

from nosa.train.__main__ import main
from nosa.train.config import load_config

SMOKE = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "train", "smoke.yaml")


def _fails(tmp_path, overrides, match):
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=match):
        main(["--config", SMOKE, f"out_dir={out}", f"data.synthetic.dir={tmp_path / 'data'}", *overrides])
    assert not out.exists(), "a failed start must not create the run directory"
    assert not (tmp_path / "data").exists()


def test_smoke_config_loads():
    cfg = load_config(SMOKE)
    assert cfg.nosa_config.block_size == 16 and cfg.seq_len % 16 == 0
    assert cfg.data.synthetic.train_examples == 8


def test_unknown_key(tmp_path):
    _fails(tmp_path, ["optim.lrr=1"], r"unknown config key\(s\) \['optim.lrr'\]")
    _fails(tmp_path, ["bogus=1"], r"unknown config key\(s\) \['bogus'\]")
    _fails(tmp_path, ["nosa.block=16"], r"NosaConfig: unknown field\(s\) \['block'\]")


def test_seq_len_not_multiple_of_block(tmp_path):
    _fails(tmp_path, ["seq_len=250"], r"seq_len=250 must be a multiple of nosa.block_size=16")


def test_missing_data_file(tmp_path):
    _fails(
        tmp_path,
        ["data.synthetic=null", f"data.train_files=[{tmp_path / 'nope.jsonl'}]"],
        r"data file not found: .*nope.jsonl",
    )


def test_wrong_type(tmp_path):
    _fails(tmp_path, ["steps=two"], r"config key steps: expected int")


@pytest.mark.parametrize(
    "config",
    [{"model_type": "bert", "architectures": ["BertModel"]}, {"model_type": "llama", "architectures": ["LlamaModel"]}],
)
def test_checkpoint_not_a_supported_causal_lm(tmp_path, config):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(config))
    _fails(tmp_path, [f"model.path={ckpt}", "model.build={}"], r"needs a causal LM of type")


def test_not_a_checkpoint(tmp_path):
    _fails(tmp_path, [f"model.path={tmp_path}"], r"is not a Hugging Face checkpoint \(no config.json\)")


def test_missing_config_file(tmp_path):
    with pytest.raises(SystemExit, match="config file not found"):
        main(["--config", str(tmp_path / "none.yaml")])
    assert not os.listdir(tmp_path)
