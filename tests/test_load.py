"""Loading a saved NOSA checkpoint: every route gives the NOSA model, with the logits of
``nosa.from_pretrained``, and none gives the dense model without an explicit choice.

Routes that depend on what an interpreter has registered (``trust_remote_code=True``, ``import
nosa`` first, neither) run in a fresh interpreter, so that the registration this process did
cannot leak into them.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import nosa  # noqa: E402
from nosa import checkpoint_format  # noqa: E402
from nosa.tiny import build_causal_lm, hybrid_layout, set_eviction_heads  # noqa: E402
from nosa.upgrade import main, upgrade  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ARCHS = ("llama", "qwen2", "qwen3", "gemma3_text")
CFG = nosa.NosaConfig.tiny(dense_len=32)  # budget 8 blocks x 16 tokens: 140 tokens are sparse
IDS = torch.randint(3, 96, (2, 140), generator=torch.Generator().manual_seed(0))


def tiny_model(arch, seed=0):
    return build_causal_lm(arch, seed=seed, vocab_size=96, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=2048, pad_token_id=0, eos_token_id=1, bos_token_id=2,
                           **hybrid_layout(arch, 2, head_dim=16)).eval()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """arch -> a NOSA checkpoint (nosa.convert + save_pretrained) with non-zero eviction heads."""
    root = tmp_path_factory.mktemp("ckpt")
    out = {}
    for arch in ARCHS:
        model = nosa.convert(tiny_model(arch), CFG)
        set_eviction_heads(model, scale=0.7, std=0.5)
        model.save_pretrained(root / arch)
        out[arch] = str(root / arch)
    return out


@torch.no_grad()
def logits(model) -> torch.Tensor:
    return model.eval()(IDS).logits


@pytest.fixture(scope="module")
def reference(ckpts):
    """arch -> logits of nosa.from_pretrained, the loader every route is compared with."""
    return {arch: logits(nosa.from_pretrained(path)) for arch, path in ckpts.items()}


def load_in_fresh_python(tmp_path, paths, imports, **kwargs) -> list[dict]:
    """Run ``imports`` then ``AutoModelForCausalLM.from_pretrained(path, **kwargs)`` for each of
    ``paths`` in a new interpreter. Per path: {"nosa_imported_before", "class", "logits"} or
    {"nosa_imported_before", "error"} (a ValueError's message)."""
    ids, out = tmp_path / "ids.pt", tmp_path / "out.pt"
    torch.save(IDS, ids)
    code = f"import sys, torch\n{imports}\n" + textwrap.dedent(f"""
        from transformers import AutoModelForCausalLM
        results = []
        for path in {list(paths)!r}:
            result = {{"nosa_imported_before": "nosa" in sys.modules}}
            try:
                model = AutoModelForCausalLM.from_pretrained(path, **{kwargs!r}).eval()
            except ValueError as err:
                result["error"] = str(err)
            else:
                with torch.no_grad():
                    result.update({{"class": type(model).__name__, "logits": model(torch.load({str(ids)!r})).logits}})
            results.append(result)
        torch.save(results, {str(out)!r})
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_MODULES_CACHE=str(tmp_path / "modules"))
    # stdin closed: transformers may ask "Do you wish to run the custom code?" on a terminal
    done = subprocess.run([sys.executable, "-c", code], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(out)


def test_trust_remote_code_gives_the_nosa_model(ckpts, reference, tmp_path):
    results = load_in_fresh_python(tmp_path, [ckpts[arch] for arch in ARCHS], "", trust_remote_code=True)
    assert not results[0]["nosa_imported_before"]  # modeling_nosa.py in the checkpoint imports it
    for arch, got in zip(ARCHS, results):
        assert got["class"] == checkpoint_format.MODEL_TYPES[arch].architecture
        torch.testing.assert_close(got["logits"], reference[arch], rtol=0, atol=1e-6)


# transformers' own import chains must not trip the registration: importing modeling_llama first
# reaches AutoModel half-way through (modeling_llama -> modeling_layers -> modeling_auto).
IMPORT_ORDERS = {
    "nosa_first": "import nosa",
    "transformers_first": "import transformers.models.auto.modeling_auto\nimport nosa",
    "llama_class_first": "import nosa\nfrom transformers import LlamaForCausalLM",
}


@pytest.mark.parametrize("order", sorted(IMPORT_ORDERS))
def test_import_nosa_then_plain_from_pretrained(ckpts, reference, tmp_path, order):
    [got] = load_in_fresh_python(tmp_path, [ckpts["qwen2"]], IMPORT_ORDERS[order])
    assert got["class"] == "NosaQwen2ForCausalLM"
    torch.testing.assert_close(got["logits"], reference["qwen2"], rtol=0, atol=1e-6)


def test_plain_from_pretrained_without_nosa_raises_naming_the_fix(ckpts, tmp_path):
    [got] = load_in_fresh_python(tmp_path, [ckpts["llama"]], "")
    assert "class" not in got and "trust_remote_code=True" in got["error"], got


def test_dense_weights_only_by_explicit_choice(ckpts, reference):
    """Two explicit ways: the NOSA class with a dense attention, or the dense base class by name."""
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    nosa_sdpa = AutoModelForCausalLM.from_pretrained(ckpts["llama"], attn_implementation="sdpa")
    dense = LlamaForCausalLM.from_pretrained(ckpts["llama"])
    assert type(nosa_sdpa).__name__ == "NosaLlamaForCausalLM" and type(dense) is LlamaForCausalLM
    torch.testing.assert_close(logits(nosa_sdpa), logits(dense), rtol=0, atol=1e-5)
    assert (logits(dense) - reference["llama"]).abs().max() > 1e-2  # sparse attention differs from dense


@pytest.mark.parametrize("arch", ARCHS)
def test_convert_and_save_write_the_nosa_format(ckpts, arch):
    nosa_type = checkpoint_format.MODEL_TYPES[arch]
    config = json.loads(Path(ckpts[arch], "config.json").read_text())
    assert config["model_type"] == nosa_type.name and config["architectures"] == [nosa_type.architecture]
    assert config["auto_map"] == nosa_type.auto_map and config["nosa"] == CFG.to_dict()
    assert Path(ckpts[arch], checkpoint_format.CODE_FILE).read_text() == checkpoint_format.CODE_TEXT
    model = nosa.from_pretrained(ckpts[arch])
    assert type(model).__name__ == nosa_type.architecture and model.config.model_type == nosa_type.name


def test_from_config_builds_nosa_attention_with_zero_a():
    from transformers import AutoModelForCausalLM

    from nosa.hf_configs import NosaQwen3Config

    config = NosaQwen3Config(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                             num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config)
    heads = [m for m in model.modules() if isinstance(m, nosa.EvictionHead)]
    assert type(model).__name__ == "NosaQwen3ForCausalLM" and model.config._attn_implementation == "nosa"
    assert len(heads) == 1 and float(heads[0].scale.detach().abs().sum()) == 0
    assert nosa.hf.nosa_config_of(model.config) == nosa.NosaConfig()


def test_nosa_checkpoint_without_eviction_heads_is_an_error(tmp_path):
    from safetensors.torch import load_file, save_file

    model = nosa.convert(tiny_model("llama"), CFG)
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    kept = {name: t for name, t in load_file(weights).items() if "nosa_evict" not in name}
    save_file(kept, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks eviction-head weights"):
        nosa.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("arch", ARCHS)
def test_legacy_checkpoint_loads(ckpts, reference, legacy_copy, tmp_path, arch):
    legacy = legacy_copy(ckpts[arch], tmp_path / "legacy")
    torch.testing.assert_close(logits(nosa.from_pretrained(legacy)), reference[arch], rtol=0, atol=1e-6)


def test_upgrade_command_rewrites_in_place_once(ckpts, reference, legacy_copy, tmp_path):
    legacy = legacy_copy(ckpts["qwen3"], tmp_path / "legacy")
    command = [sys.executable, "-m", "nosa.upgrade", legacy]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    first = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 0 and "upgraded to the NOSA checkpoint format" in first.stdout, first.stderr
    config = Path(legacy, "config.json").read_text()
    assert json.loads(config) == json.loads(Path(ckpts["qwen3"], "config.json").read_text())  # as if saved now
    assert Path(legacy, checkpoint_format.CODE_FILE).read_text() == checkpoint_format.CODE_TEXT
    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "already in the NOSA checkpoint format" in again.stdout
    assert Path(legacy, "config.json").read_text() == config
    from transformers import AutoModelForCausalLM

    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(legacy)), reference["qwen3"],
                               rtol=0, atol=1e-6)


def test_upgrade_refuses_what_is_not_a_nosa_checkpoint(ckpts, legacy_copy, tmp_path):
    dense = tmp_path / "dense"
    tiny_model("llama").save_pretrained(dense)
    malformed = legacy_copy(ckpts["llama"], tmp_path / "malformed")
    config = json.loads(Path(malformed, "config.json").read_text())
    config["nosa"]["topk_blocks"] = 2
    Path(malformed, "config.json").write_text(json.dumps(config))
    headless = tmp_path / "headless"  # a valid legacy config.json, no weights
    headless.mkdir()
    config["nosa"] = CFG.to_dict()
    Path(headless, "config.json").write_text(json.dumps(config))
    gpt2 = tmp_path / "gpt2"
    build_causal_lm("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=50).save_pretrained(gpt2)
    cases = {
        str(dense): "a dense checkpoint, not a NOSA one",
        malformed: "malformed 'nosa' section.*topk_blocks=2",
        str(headless): "no \\*.nosa_evict.\\* tensors",
        str(gpt2): "model_type 'gpt2'",
        str(tmp_path / "nowhere"): "no config.json",
    }
    for path, message in cases.items():
        before = sorted(os.listdir(path)) if os.path.isdir(path) else None
        config_before = Path(path, "config.json").read_text() if before else None
        with pytest.raises(ValueError, match=message):
            upgrade(path)
        if before:
            assert sorted(os.listdir(path)) == before and Path(path, "config.json").read_text() == config_before
    assert main([str(dense), str(gpt2)]) == 1
