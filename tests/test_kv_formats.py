"""nosa.bench.kv_formats (scripts/bench_kv_formats.py): the formats it measures and the measurement itself
on a tiny model, where an exact format must move nothing and a broken one must show."""

import pytest
import torch

from nosa import kvquant
from nosa.bench import kv_formats
from nosa.bench.tiny_checkpoint import make_tokenizer
from nosa.tiny import build_causal_lm


def test_served_formats_are_the_spec_and_the_what_ifs_keep_their_bounds():
    x = torch.randn(1, 2, 130, 16, dtype=torch.float64) + 40 * torch.randn(1, 2, 1, 16, dtype=torch.float64)
    for name, (k_rt, v_rt, kind) in kv_formats.FORMATS.items():
        assert k_rt(x).shape == x.shape and v_rt(x).shape == x.shape, name
    int8_k, _, _ = kv_formats.FORMATS["int8"]
    assert torch.equal(int8_k(x), kvquant.roundtrip(x, torch.int8))
    # served int8 keys divide by the layer's key factors [H, D] when the checkpoint has them
    factor = kvquant.key_factors(x.abs().amax(dim=(0, 2)).float())
    assert torch.equal(int8_k(x, factor), kvquant.roundtrip(x, torch.int8, factor=factor[:, None, :]))
    assert not torch.equal(int8_k(x, factor), int8_k(x))
    unfactored, _, kind = kv_formats.FORMATS["int8, no key factors"]
    assert kind == "unfactored" and torch.equal(unfactored(x, factor), int8_k(x))
    # a large per-channel offset (all of a block's tokens share it): removing the block mean first leaves
    # fp8 only the spread around it, and per-channel int8 scales fit each channel's own range
    f8 = kvquant.roundtrip(x, torch.float8_e4m3fn)
    smooth = kv_formats.block_mean_removed(torch.float8_e4m3fn, block=64)(x)
    assert (smooth - x).abs().mean() < 0.5 * (f8 - x).abs().mean()
    chan = kv_formats.per_channel(torch.int8, block=64)(x)
    for s in range(0, 130, 64):  # per block, per channel: at most half a step of that channel's range
        xs = x[:, :, s:s + 64]
        step = xs.abs().amax(dim=2, keepdim=True) / 127
        assert ((chan[:, :, s:s + 64] - xs).abs() <= step / 2 + 1e-12).all()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-lm")
    model = build_causal_lm("llama", seed=0, attn_implementation="sdpa", vocab_size=300, hidden_size=64,
                            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=512, pad_token_id=257, eos_token_id=257, bos_token_id=256)
    model.save_pretrained(path)
    make_tokenizer(str(path))
    return str(path)


def test_an_exact_format_moves_nothing_and_a_broken_one_shows(tiny_model, monkeypatch):
    monkeypatch.setitem(kv_formats.FORMATS, "exact", (kv_formats.exact, kv_formats.exact, "what-if"))
    monkeypatch.setitem(kv_formats.FORMATS, "V zeroed", (kv_formats.exact, torch.zeros_like, "what-if"))
    out = kv_formats.measure(tiny_model, 96, 2, ["exact", "V zeroed", "int8"], progress=False)
    got = {r["format"]: r for r in out["formats"]}
    assert out["scored_positions"] == 96 and out["exact_ppl"] > 1 and (out["layers_quantized"], out["layers"]) == (2, 2)
    assert got["exact"]["kl"] == pytest.approx(0, abs=1e-7) and got["exact"]["greedy_agreement"] == 1.0
    assert got["exact"]["ppl_ratio"] == pytest.approx(1.0, abs=1e-6)
    assert got["V zeroed"]["kl"] > 100 * max(got["int8"]["kl"], 1e-6)  # the format reached every layer's attention
    assert 0 <= got["int8"]["kl"] < 1e-3
    # head_dim 16: K and V in a byte each, two float32 scales and the float32 eviction score, over bf16's
    assert got["int8"]["bytes_per_token_vs_bf16"] == pytest.approx((2 * 16 + 8 + 4) / (2 * 16 * 2 + 4))
    with pytest.raises(SystemExit, match="unknown formats"):
        kv_formats.measure(tiny_model, 96, 1, ["int4"], progress=False)
    with pytest.raises(SystemExit, match="fewer than"):
        kv_formats.measure(tiny_model, 10 ** 9, 1, ["int8"], progress=False)


def test_a_window_layer_keeps_its_kv_exact(tmp_path, monkeypatch):
    """Gemma 3's sliding-window layers never offload (their window stays on the device): the formats
    leave them exact, so a model of window layers only is not moved even by a zeroed V."""
    from nosa.tiny import hybrid_layout

    layout = hybrid_layout("gemma3_text", 2, head_dim=16, window=16)
    model = build_causal_lm("gemma3_text", seed=0, attn_implementation="sdpa", vocab_size=300, hidden_size=64,
                            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=512, pad_token_id=257, eos_token_id=257, bos_token_id=256,
                            **dict(layout, layer_types=["sliding_attention"] * 2))
    model.save_pretrained(tmp_path)
    make_tokenizer(str(tmp_path))
    monkeypatch.setitem(kv_formats.FORMATS, "V zeroed", (kv_formats.exact, torch.zeros_like, "what-if"))
    out = kv_formats.measure(str(tmp_path), 96, 1, ["V zeroed"], progress=False)
    assert (out["layers_quantized"], out["layers"]) == (0, 2)
    assert out["formats"][0]["kl"] == pytest.approx(0, abs=1e-7)
    # the exact model is the SDPA model, its 16-token windows included (the window is shorter than the rows)
    from transformers import AutoTokenizer

    (row,) = kv_formats.prose_windows(AutoTokenizer.from_pretrained(tmp_path), 96, 1)
    with torch.no_grad():
        logits = model.eval()(row).logits[0, -49:-1].float()
    nll = torch.nn.functional.cross_entropy(logits, row[0, -48:])
    assert out["exact_ppl"] == pytest.approx(float(nll.exp()), rel=1e-5)


def test_kv_calibrate_writes_factors_that_follow_the_keys_ranges(tiny_model, tmp_path):
    """python -m nosa.kv_calibrate on a tiny Llama whose layer 0 has one key channel pair 50x larger
    (k_proj rows 3 and 3 + D/2: RoPE rotates them into each other): that layer's factors are 1 there and
    small elsewhere, layer 1's are not; each head's largest factor is 1, none below the floor; the
    file is what the server and the benchmarks load."""
    import shutil

    from transformers import AutoModelForCausalLM

    from nosa import kv_calibrate

    path = str(tmp_path / "ckpt")
    shutil.copytree(tiny_model, path)
    model = AutoModelForCausalLM.from_pretrained(path)
    d = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        w = model.model.layers[0].self_attn.k_proj.weight
        for h in range(model.config.num_key_value_heads):
            w[h * d + 3] *= 50
            w[h * d + 3 + d // 2] *= 50
    model.save_pretrained(path)
    assert kv_calibrate.main([path, "--length", "64", "--windows", "1"]) == 0
    factors = kv_calibrate.load_key_factors(path)
    assert sorted(factors) == [0, 1] and factors[0].shape == (2, d)
    for f in factors.values():
        assert torch.allclose(f.amax(dim=-1), torch.ones(2)) and float(f.min()) >= kvquant.FACTOR_FLOOR
    big = [3, 3 + d // 2]
    rest = [c for c in range(d) if c not in big]
    assert float(factors[0][:, big].max(dim=-1).values.min()) == 1.0
    assert float(factors[0][:, rest].max()) < 0.2 < float(factors[1][:, rest].max())
    with pytest.raises(SystemExit):
        kv_calibrate.main([path, "--windows", "0"])
