"""End-to-end runs of the smoke config in this process (one rank, ZeRO-2 over gloo): a dense step,
conversion, two NOSA steps, checkpoints, resume, and the offline W&B run."""

import json
import math
import os

import pytest
import torch

import nosa
from nosa.train import checkpoint
from nosa.train.config import load_config
from nosa.train.loop import run

SMOKE = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "train", "smoke.yaml")


def _metrics(out_dir):
    """step -> its logged values; rows logged at one step merge, as W&B merges them."""
    rows = {}
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        for row in map(json.loads, f):
            rows.setdefault(row["step"], {}).update(row)
    return rows


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """dense_steps=1 then 2 NOSA steps, a checkpoint after every step past the first."""
    tmp = str(tmp_path_factory.mktemp("first"))
    os.chdir(os.path.join(os.path.dirname(__file__), "..", ".."))
    overrides = [
        f"out_dir={tmp}/run",
        f"data.synthetic.dir={tmp}/data",
        "dense_steps=1",
        "steps=2",
        "save_every=1",
        "keep_checkpoints=2",
    ]
    cfg = load_config(SMOKE, overrides)
    result = run(cfg)
    return cfg, result


def test_finite_loss_and_checkpoints(first):
    cfg, result = first
    rows = _metrics(cfg.out_dir)
    assert sorted(rows) == [1, 2, 3]
    assert all(math.isfinite(r["train/loss"]) for r in rows.values())
    assert rows[1]["train/phase"] == 0 and rows[3]["train/phase"] == 1
    # the converted model's eval, at the step the NOSA phase starts from
    assert math.isfinite(rows[1]["converted/loss"]) and 0 <= rows[1]["converted/acc_token"] <= 1
    ckpts = sorted(os.listdir(os.path.join(cfg.out_dir, "checkpoints")))
    # step 1 ends the dense phase (kept), steps 2 and 3 are the newest two.
    assert ckpts == ["step-000001", "step-000002", "step-000003"]
    assert os.path.realpath(os.path.join(cfg.out_dir, "dense")).endswith("step-000001")
    assert os.path.realpath(os.path.join(cfg.out_dir, "nosa")).endswith("step-000003")
    final = os.path.join(cfg.out_dir, "checkpoints", "step-000003")
    with open(os.path.join(final, "config.json")) as f:
        saved = json.load(f)
    assert saved["nosa"] == cfg.nosa.to_dict() and saved["model_type"] == "nosa_llama"  # the NOSA format
    with open(os.path.join(cfg.out_dir, "dense", "config.json")) as f:
        dense = json.load(f)
    assert "nosa" not in dense and dense["model_type"] == "llama"
    for name in ("nosa_train.json", "trainer_state.json", "tokenizer.json", "model.safetensors", "modeling_nosa.py"):
        assert os.path.isfile(os.path.join(final, name)), name
    assert checkpoint.read_state(final) == {"step": 3, "tokens": 3 * 512, "phase": "nosa"}  # smoke: 2 x 256 tokens
    assert checkpoint.read_run_config(final) == cfg.to_dict()
    with pytest.raises(ValueError, match="no trainer_state.json"):
        checkpoint.read_state(cfg.out_dir)


def test_checkpoint_reloads_identical_logits(first):
    cfg, result = first
    path = os.path.join(cfg.out_dir, "checkpoints", "step-000003")
    model = result["model"].eval()
    loaded = nosa.from_pretrained(path).eval()  # the loader the serving backend uses
    from transformers import AutoConfig, AutoModelForCausalLM

    from nosa.hf import nosa_config_of

    assert nosa_config_of(AutoConfig.from_pretrained(path)) == cfg.nosa
    ids = torch.randint(0, model.config.vocab_size, (1, 96), generator=torch.Generator().manual_seed(0))
    plain = AutoModelForCausalLM.from_pretrained(path).eval()  # a NOSA model too: nosa registered its model types
    assert type(plain).__name__ == "NosaLlamaForCausalLM"
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
        assert torch.equal(want, got) and torch.equal(want, plain(input_ids=ids).logits)
    evict = [n for n, _ in loaded.named_parameters() if "nosa_evict" in n]
    assert evict and any(p.abs().sum() > 0 for n, p in loaded.named_parameters() if n.endswith("nosa_evict.scale"))


def test_resume_gives_the_same_next_step_loss(first, tmp_path):
    cfg, _ = first
    ckpt = os.path.join(cfg.out_dir, "checkpoints", "step-000002")
    overrides = [
        f"out_dir={tmp_path}/resumed",
        f"data.synthetic.dir={cfg.data.synthetic.dir}",
        "dense_steps=1",
        "steps=2",
        f"resume={ckpt}",
        "wandb.mode=disabled",
    ]
    run(load_config(SMOKE, overrides))
    resumed = _metrics(f"{tmp_path}/resumed")
    assert sorted(resumed) == [3]
    uninterrupted = _metrics(cfg.out_dir)[3]["train/loss"]
    assert resumed[3]["train/loss"] == pytest.approx(uninterrupted, rel=1e-6, abs=1e-6)


def test_offline_wandb_run_holds_the_logged_keys(first):
    from nosa.bench.wandb_run import read_run

    cfg, _ = first
    wandb_run = read_run(cfg.out_dir)
    keys = {k for row in wandb_run["history"] for k in row}
    for key in (
        "train/loss",
        "train/tokens_per_s",
        "lr/base",
        "lr/evict",
        "evict_A/layer0",
        "evict_A/layer1",
        "select/churn_mean",
        "select/churn_max",
        "select/mass",
        "select/mass/layer0",
        "eval/acc",
        "eval/loss",
    ):
        assert key in keys, key
    assert wandb_run["config"]["nosa"] == cfg.nosa.to_dict()
    assert wandb_run["config"]["seq_len"] == cfg.seq_len


class _FailingEngine:
    def __init__(self, module):
        self.module = module

    def save_checkpoint(self, *args, **kwargs):
        raise OSError("disk full")


def test_interrupted_save_leaves_no_checkpoint(tmp_path, first):
    cfg, result = first
    with pytest.raises(OSError, match="disk full"):
        checkpoint.save(_FailingEngine(result["model"]), _Tok(), {}, str(tmp_path), 7, {})
    assert checkpoint.latest(str(tmp_path)) is None
    assert not any(name.startswith("step-") for name in os.listdir(tmp_path / "checkpoints"))


class _Tok:
    def save_pretrained(self, path):
        open(os.path.join(path, "tokenizer.json"), "w").close()


def test_checkpoint_is_accepted_by_the_serving_loader(first):
    serve_ckpt = pytest.importorskip("nosa.serve.checkpoint")
    from nosa.serve.parallel import KVHeadShard

    cfg, result = first
    path = os.path.join(cfg.out_dir, "nosa")
    config, from_checkpoint = serve_ckpt.load_nosa_config(path)
    assert from_checkpoint and config == cfg.nosa
    hf = result["model"].config
    one_rank = KVHeadShard(hf.num_key_value_heads, hf.num_key_value_heads)  # every KV head, no TP
    heads = serve_ckpt.load_eviction_heads(
        path, list(range(hf.num_hidden_layers)), one_rank, hf.hidden_size // hf.num_attention_heads, "cpu"
    )
    trained = result["model"].model.layers[1].self_attn.nosa_evict
    assert torch.equal(heads[1].scale, trained.scale.detach().float())
    assert torch.equal(heads[1].proj.weight, trained.proj.weight.detach().float())


def test_curriculum_trains_short_rows_first(tmp_path, smoke_overrides, monkeypatch):
    """A dense step on 128-token rows (twice as many per micro step), then the rest at seq_len;
    the stage's data file is generated beside train.jsonl with facts outside sinks and window."""
    from nosa.train import loop

    shapes = []
    real = loop.batch_at

    def recording(*args, **kwargs):
        batch = real(*args, **kwargs)
        shapes.append(tuple(batch["input_ids"].shape))
        return batch

    monkeypatch.setattr(loop, "batch_at", recording)
    overrides = smoke_overrides(str(tmp_path), dense_steps=2, steps=1, eval_every=0, save_every=0)
    cfg = load_config(SMOKE, overrides + ["curriculum=[[1, 128]]", "wandb.mode=disabled"])
    run(cfg)
    # grad_accum 2: two micro batches per step
    assert shapes == [(2, 128)] * 2 + [(1, 256)] * 4
    data = cfg.data.synthetic.dir
    with open(os.path.join(data, "meta.json")) as f:
        meta = json.load(f)
    assert meta["lengths"] == [128, 256]
    assert meta["head"] == 16 and meta["tail"] == 32  # smoke: 1 sink block, 2 window blocks of 16
    assert os.path.isfile(os.path.join(data, "train-128.jsonl"))


def test_self_distillation_logs_its_kl_and_starts_from_the_dense_teacher(first, tmp_path):
    """data.kl_weight: the NOSA fine-tune of the dense checkpoint, with the KL from that checkpoint
    (frozen) beside the token loss, and the selection loss (data.select_weight); the logged terms
    add up to the loss."""
    cfg, _ = first
    dense = os.path.realpath(os.path.join(cfg.out_dir, "dense"))
    overrides = [f"out_dir={tmp_path}/run", f"data.synthetic.dir={tmp_path}/data", "dense_steps=0", "steps=2",
                 "model.build=null", f"model.path={dense}", "data.kl_weight=0.5", "data.select_weight=0.25",
                 "wandb.mode=disabled"]
    run(load_config(SMOKE, overrides))
    rows = [r for r in _metrics(f"{tmp_path}/run").values() if "train/loss" in r]
    assert len(rows) == 2
    for row in rows:
        assert row["train/kl"] > 0  # the NOSA attention (A = 0 at step 1) is not the dense teacher's
        assert row["train/select"] > 0  # the training-free score is not the dense attention's block mass
        terms = row["train/ce"] + 0.5 * row["train/kl"] + 0.25 * row["train/select"]
        assert terms == pytest.approx(row["train/loss"], rel=1e-5)


def test_self_distillation_needs_a_pretrained_teacher(smoke_overrides, tmp_path):
    with pytest.raises(ValueError, match="data.kl_weight needs model.path"):
        load_config(SMOKE, smoke_overrides(str(tmp_path)) + ["data.kl_weight=1.0"])
    with pytest.raises(ValueError, match="data.select_weight=-1.0"):
        load_config(SMOKE, smoke_overrides(str(tmp_path)) + ["data.select_weight=-1"])


def test_a_hybrid_gemma3_trains_and_its_checkpoint_keeps_the_sliding_layers_dense(tmp_path, smoke_overrides):
    """The smoke run on a tiny Gemma 3 (sliding-window, full, sliding, full): conversion and a NOSA
    step; eviction heads only in the full layers, trained; the checkpoint reloads
    (nosa.from_pretrained) with the trained model's logits."""
    build = ("{model_type: gemma3_text, hidden_size: 64, intermediate_size: 128, num_hidden_layers: 4, "
             "num_attention_heads: 4, num_key_value_heads: 1, head_dim: 16, query_pre_attn_scalar: 24, "
             "sliding_window: 32, max_position_embeddings: 1024, layer_types: [sliding_attention, full_attention, "
             "sliding_attention, full_attention]}")
    overrides = smoke_overrides(str(tmp_path), dense_steps=0, steps=1, save_every=0)
    cfg = load_config(SMOKE, overrides + [f"model.build={build}", "wandb.mode=disabled"])
    result = run(cfg)
    model = result["model"].eval()
    assert [name for name, _ in nosa.hf.nosa_attention_modules(model)] == [
        "model.layers.1.self_attn", "model.layers.3.self_attn"]
    assert all(float(attn.nosa_evict.scale.detach().abs().sum()) > 0  # trained: A moved from 0
               for _, attn in nosa.hf.nosa_attention_modules(model))
    loaded = nosa.from_pretrained(os.path.join(cfg.out_dir, "nosa")).eval()
    assert type(loaded).__name__ == "NosaGemma3ForCausalLM"
    ids = torch.randint(3, 200, (1, 200))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-4)


def test_a_checkpoint_without_optimizer_state_serves_but_does_not_resume(first, tmp_path):
    """save_optimizer: false writes the model and the run's state, no DeepSpeed state; the model is
    the one the full checkpoint holds, and resuming inside the phase from it stops naming the fix."""
    cfg, _ = first
    overrides = [f"out_dir={tmp_path}/lean", f"data.synthetic.dir={cfg.data.synthetic.dir}", "dense_steps=1",
                 "steps=2", "save_every=1", "save_optimizer=false", "wandb.mode=disabled"]
    run(load_config(SMOKE, overrides))
    lean = os.path.join(tmp_path, "lean", "checkpoints", "step-000002")
    full = os.path.join(cfg.out_dir, "checkpoints", "step-000002")
    assert not os.path.exists(os.path.join(lean, "deepspeed")) and os.path.isdir(os.path.join(full, "deepspeed"))
    ids = torch.randint(0, 100, (1, 64))
    with torch.no_grad():
        logits = [nosa.from_pretrained(p).eval()(ids).logits for p in (lean, full)]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)
    resumed = [f"out_dir={tmp_path}/again", f"data.synthetic.dir={cfg.data.synthetic.dir}", "dense_steps=1",
               "steps=3", f"resume={lean}", "wandb.mode=disabled"]
    with pytest.raises(ValueError, match="no optimizer state.*save_optimizer: false.*resume=null"):
        run(load_config(SMOKE, resumed))


def test_steps_0_fits_the_eviction_heads_only(tmp_path, smoke_overrides):
    """steps: 0 with distill.rows: convert, fit the heads, write ``fitted`` and link ``nosa`` to it, no
    fine-tune step and no DeepSpeed checkpoint; without distill.rows there is nothing to run."""
    overrides = smoke_overrides(str(tmp_path), dense_steps=0, steps=0) + [
        "distill.rows=4", "distill.steps=3", "wandb.mode=disabled"]
    cfg = load_config(SMOKE, overrides)
    assert cfg.fit_only
    result = run(cfg)
    fitted = os.path.join(cfg.out_dir, "fitted")
    assert os.path.islink(os.path.join(cfg.out_dir, "nosa"))
    assert os.path.realpath(os.path.join(cfg.out_dir, "nosa")) == os.path.realpath(fitted)
    assert not os.path.exists(os.path.join(cfg.out_dir, "checkpoints"))
    assert "distill/loss" in result["metrics"] and "train/loss" not in result["metrics"]
    loaded = nosa.from_pretrained(os.path.join(cfg.out_dir, "nosa")).eval()
    scales = [attn.nosa_evict.scale for _, attn in nosa.hf.nosa_attention_modules(loaded)]
    assert scales and all(torch.all(s == cfg.distill.scale) for s in scales)  # A set by the fit
    ids = torch.randint(3, 100, (1, 96))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, result["model"].eval()(ids).logits, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="steps: 0 with distill.rows > 0"):
        load_config(SMOKE, smoke_overrides(str(tmp_path / "none"), dense_steps=0, steps=0))
