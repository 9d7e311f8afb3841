"""Fitting the eviction heads to the dense attention (nosa.train.distill)."""

import pytest
import torch

from nosa.config import NosaConfig
from nosa.train.config import DistillSection
from nosa.train.distill import attention_targets, balanced_bce, fit_eviction_heads

CFG = NosaConfig(block_size=4, compress_kernel=2, compress_stride=2, sink_blocks=1, window_blocks=2,
                 topk_blocks=4, query_blocks=1, dense_len=0)


@pytest.mark.parametrize("weighted", [False, True])
def test_targets_match_a_brute_force_over_far_rows(weighted):
    torch.manual_seed(0)
    length, hq, hkv, d = 24, 4, 2, 8
    q, k = torch.randn(length, hq, d), torch.randn(length, hkv, d)
    # rows weighed as the loss weighs them: 0 (no label), 1 (filler), 8 (predicts an answer)
    weight = torch.tensor([0.0, 1.0, 8.0])[torch.randint(0, 3, (length,))] if weighted else None
    target, valid = attention_targets(q, k, CFG, scale=0.5, weight=weight)
    w = torch.ones(length) if weight is None else weight / weight.max()
    want = torch.zeros(length, hkv)
    seen = torch.zeros(length, dtype=torch.bool)
    for t in range(length):
        if w[t] == 0:
            continue
        for h in range(hq):
            logits = (q[t, h] @ k[: t + 1, h // 2].T) * 0.5
            p = torch.softmax(logits, -1)
            for j in range(t + 1):
                if t // 4 - j // 4 >= CFG.window_blocks:  # outside the row's local window
                    want[j, h // 2] = max(want[j, h // 2], w[t] * p[j])
                    seen[j] = True
    torch.testing.assert_close(target, want)
    assert torch.equal(valid[:, 0], seen & (torch.arange(length) >= 4))  # sink block excluded


def test_fit_learns_which_values_are_attended():
    from nosa.eviction import EvictionHead
    from nosa.train.distill import fit_head

    torch.manual_seed(0)
    n, hkv, d = 512, 2, 8
    v = torch.randn(n, hkv, d)
    truth = torch.randn(hkv, d) * 2  # the direction of v that later queries attend to, per KV head
    target = torch.sigmoid((v * truth).sum(-1) - 2)
    valid = torch.rand(n, hkv) > 0.1
    head = EvictionHead(hkv, d)
    before, after = fit_head(head, v, target, valid, steps=400, lr=3e-2)
    assert after < before
    with torch.no_grad():
        score = head.proj(v.flatten(-2))  # cis ranks tokens like this logit (A > 0)
    for h in range(hkv):  # the fitted head ranks tokens as the attention does
        top = score[:, h].topk(20).indices
        assert target[top, h].mean() > 0.9 * target[:, h].topk(20).values.mean()


def test_window_rank_loss_is_the_listwise_cross_entropy_of_each_row():
    """By hand: per row and KV head, the windows' share of the target mass against softmax(window
    mean of softplus(logit) / tau), over the windows whose tokens all have a target."""
    import torch.nn.functional as F

    from nosa.compress import compress_windows
    from nosa.train.distill import WindowRank

    torch.manual_seed(3)
    lengths, hkv, d = [12, 10], 2, 4
    x = torch.randn(sum(lengths), hkv * d)
    proj = torch.nn.Linear(hkv * d, hkv)
    target, valid = torch.rand(sum(lengths), hkv), torch.rand(sum(lengths), hkv) > 0.15
    target[12:, 1] = 0.0  # row 1, head 1 attends nowhere: no term
    rank = WindowRank(lengths, CFG, rank_tau=0.1, rows_per_step=1)
    gen = torch.Generator().manual_seed(5)
    row = int(torch.randint(2, (1,), generator=torch.Generator().manual_seed(5)))
    got = rank.loss(proj, x, target, valid, gen)
    rows = slice(0, 12) if row == 0 else slice(12, 22)
    score = compress_windows(F.softplus(proj(x[rows])), CFG)
    mass = compress_windows(target[rows], CFG)
    whole = compress_windows(valid[rows].float(), CFG) == 1
    terms = []
    for h in range(hkv):
        m = mass[whole[:, h], h]
        if m.sum() == 0:
            continue
        terms.append(-(m / m.sum() * torch.log_softmax(score[whole[:, h], h] / 0.1, 0)).sum())
    torch.testing.assert_close(got, torch.stack(terms).mean())


def test_window_rank_orders_windows_where_the_token_loss_does_not():
    """Each window holds one attended token (the target) among tokens that carry no target; the
    attended token's value says nothing, but the other tokens of an attended window share a
    direction (a sentence that is read from, not only its one token). The token loss cannot rank the
    windows (its attended tokens are noise); the window term learns the shared direction."""
    from nosa.compress import compress_windows
    from nosa.eviction import EvictionHead
    from nosa.train.distill import WindowRank, fit_head

    torch.manual_seed(0)
    cfg = NosaConfig(block_size=8, compress_kernel=8, compress_stride=8, sink_blocks=1, window_blocks=1,
                     topk_blocks=4, query_blocks=1, dense_len=0)
    rows, length, hkv, d = 16, 256, 1, 8
    truth = torch.randn(d)
    truth /= truth.norm()
    v = torch.randn(rows * length, hkv, d)
    target = torch.zeros(rows * length, hkv)
    hot = []
    for r in range(rows):
        for w in torch.randperm(length // 8 - 1)[:3].tolist():
            start = r * length + (w + 1) * 8
            v[start + 1:start + 8, 0] += 2.5 * truth  # the window's other tokens share a direction
            target[start, 0] = 0.5  # the attended token itself is random
            hot.append(start // 8)
    valid = torch.ones_like(target, dtype=torch.bool)
    top = {}
    for weight in (0.0, 1.0):
        head = EvictionHead(hkv, d)
        torch.manual_seed(1)
        head.proj.reset_parameters()
        rank = WindowRank([length] * rows, cfg, weight, rank_tau=0.05) if weight else None
        fit_head(head, v, target, valid, steps=200, lr=3e-2, batch=512, rank=rank)
        with torch.no_grad():
            score = compress_windows(torch.nn.functional.softplus(head.proj(v.flatten(-2))), cfg)[:, 0]
        top[weight] = set(score.topk(len(hot)).indices.tolist())
    hot = set(hot)
    assert len(top[1.0] & hot) > 0.9 * len(hot)
    assert len(top[0.0] & hot) < 0.5 * len(hot)


def test_balanced_bce_weighs_the_attended_tokens_like_all_tokens():
    torch.manual_seed(2)
    n, hkv = 50, 2
    logit, target = torch.randn(n, hkv), torch.rand(n, hkv) ** 4
    valid = torch.rand(n, hkv) > 0.2
    want_num, want_den = 0.0, 0.0
    for h in range(hkv):
        t, p = target[valid[:, h], h], torch.sigmoid(logit[valid[:, h], h])
        weight = 1 + t * len(t) / t.sum()  # the attended tokens weigh as much as all tokens
        bce = -(t * torch.log(p) + (1 - t) * torch.log(1 - p))
        want_num, want_den = want_num + (bce * weight).sum(), want_den + weight.sum()
    torch.testing.assert_close(balanced_bce(logit, target, valid), want_num / want_den)


def test_fit_on_a_model_sets_a_and_keeps_outputs_finite():
    import nosa
    from nosa.tiny import build_causal_lm

    torch.manual_seed(0)
    model = build_causal_lm("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128)
    cfg = NosaConfig(block_size=8, compress_kernel=4, compress_stride=2, sink_blocks=1, window_blocks=2,
                     topk_blocks=5, query_blocks=1, dense_len=0)
    nosa.convert(model, cfg)
    rows = [{"input_ids": torch.randint(0, 64, (64,)), "position_ids": torch.arange(64)} for _ in range(2)]
    out = fit_eviction_heads(model, rows, cfg, DistillSection(steps=20, lr=3e-2, scale=0.25), print0=lambda *a: None)
    assert out["distill/loss"] < out["distill/loss_first"]
    for layer in model.model.layers:
        assert torch.equal(layer.self_attn.nosa_evict.scale, torch.full((1,), 0.25))
    assert torch.isfinite(model(input_ids=rows[0]["input_ids"][None]).logits).all()


def test_bad_distill_settings_are_refused():
    import os

    from nosa.train.config import load_config

    smoke = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "train", "smoke.yaml")
    with pytest.raises(ValueError, match="distill.scale=0.0"):
        load_config(smoke, ["distill.rows=4", "distill.scale=0.0"])
    with pytest.raises(ValueError, match="distill.rank_weight=-1"):
        load_config(smoke, ["distill.rank_weight=-1"])
    with pytest.raises(ValueError, match="distill.rank_tau=0"):
        load_config(smoke, ["distill.rank_tau=0"])
    # the keys of earlier versions fail, naming the new ones
    with pytest.raises(ValueError, match="distill_rank is now distill.rank_weight"):
        load_config(smoke, ["distill_rank=1"])
    with pytest.raises(ValueError, match="distill_rows is now distill.rows, distill_steps is now distill.steps"):
        load_config(smoke, ["distill_rows=4", "distill_steps=2"])
    with pytest.raises(ValueError, match="answer_weight=-1"):
        load_config(smoke, ["data.answer_weight=-1"])
