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
    assert cfg.nosa.block_size == 16 and cfg.seq_len % 16 == 0
    assert cfg.data.synthetic.train_examples == 8


def test_nosa_section_is_a_nosa_config_built_at_load(tmp_path):
    from nosa.config import NosaConfig

    cfg = load_config(SMOKE, ["nosa.topk_blocks=6"])
    assert isinstance(cfg.nosa, NosaConfig) and cfg.nosa.topk_blocks == 6
    assert cfg.to_dict()["nosa"] == cfg.nosa.to_dict()  # what the run config and W&B record
    _fails(tmp_path, ["nosa.topk_blocks=0"], r"NosaConfig.topk_blocks=0 must be positive")


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


def test_every_config_field_says_what_it_means():
    """The docs render the field reference from these comments: each field of NosaConfig, TrainConfig
    and its sections has a comment on its line or on the line(s) directly above it."""
    import ast
    import dataclasses
    import inspect
    import io
    import sys
    import tokenize

    from nosa.config import NosaConfig
    from nosa.train import config as train_config

    classes = [NosaConfig, train_config.TrainConfig]
    classes += [c for c in vars(train_config).values() if isinstance(c, type) and c.__name__.endswith("Section")]
    missing = []
    for cls in classes:
        source = inspect.getsource(sys.modules[cls.__module__])
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
        commented = {t.start[0] for t in tokens if t.type == tokenize.COMMENT}
        code = {t.start[0] for t in tokens if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE,
                                                              tokenize.INDENT, tokenize.DEDENT)}
        node = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
        lines = {n.target.id: (n.lineno, n.end_lineno) for n in node.body if isinstance(n, ast.AnnAssign)}
        for f in dataclasses.fields(cls):
            first, last = lines[f.name]
            above = first - 1 in commented and first - 1 not in code
            if not above and not any(line in commented for line in range(first, last + 1)):
                missing.append(f"{cls.__name__}.{f.name}")
    assert not missing, "fields without a comment: " + ", ".join(missing)
