"""The masked dense path (nosa.attention.masked) against the gathered path
(nosa.attention.gathered.attend_grouped): outputs and gradients of q, k, v and cis, and the
dispatch between them."""

import pytest
import torch

from nosa import EvictionHead, NosaConfig, nosa_prefill, nosa_prefill_varlen
from nosa.attention import gathered, masked
from nosa.attention.gathered import attend_grouped
from nosa.attention.masked import attend_masked, use_masked


def make(length, hq, hkv, d, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(length, h, d, generator=g, dtype=dtype) for h in (hq, hkv, hkv))
    cis = torch.randn(length, hkv, generator=g, dtype=dtype) * 0.7
    return q, k, v, cis


def both_paths(q, k, v, cis, sel, positions, cfg, scale):
    """(out, grads of q, k, v, cis) of the gathered and the masked path for one random weighting."""
    weight = torch.randn(q.shape[0], q.shape[1], v.shape[-1], generator=torch.Generator().manual_seed(1),
                         dtype=q.dtype)
    results = []
    for fn in (attend_grouped, attend_masked):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v, cis)]
        out = fn(*leaves, sel, positions, cfg, scale)
        grads = torch.autograd.grad((out * weight).sum(), leaves)
        results.append((out, grads))
    return results


def assert_paths_agree(results, atol, rtol):
    (out_g, grads_g), (out_m, grads_m) = results
    torch.testing.assert_close(out_m, out_g, atol=atol, rtol=rtol)
    for name, a, b in zip("q k v cis".split(), grads_m, grads_g):
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol, msg=name)


@pytest.mark.parametrize("hq, hkv", [(4, 2), (6, 3), (8, 1), (2, 2)])
@pytest.mark.parametrize("first", [0, 57])  # every row of a context, or its last rows only
def test_masked_equals_gathered_outputs_and_gradients(hq, hkv, first):
    """Selections of nosa_prefill with the eviction heads on (budget well below the context), rows
    starting at position 0 or mid-block (the first rows then see a partial current block)."""
    cfg = NosaConfig.tiny(topk_blocks=5, query_blocks=2)
    length, d = 220, 8
    q, k, v, cis = make(length, hq, hkv, d, seed=hq + hkv)
    _, sel = nosa_prefill(q, k, v, cis, cfg, 0.35)
    positions = torch.arange(first, length)
    results = both_paths(q[first:], k, v, cis, sel[first:], positions, cfg, 0.35)
    assert_paths_agree(results, atol=2e-5, rtol=1e-4)
    assert cfg.num_blocks(length) == 14 and ((sel[-1] >= 0).sum(-1) == 5).all()  # sparse for real


def test_masked_equals_gathered_in_float64_with_padded_and_empty_selections():
    """Rows whose selection is partly or wholly -1 (a row with no key: output 0, no gradient),
    duplicate-free arbitrary blocks, positions that skip rows (compacted contexts), float64."""
    cfg = NosaConfig.tiny(topk_blocks=6, query_blocks=2)
    length, hq, hkv, d = 150, 4, 2, 8
    q, k, v, cis = make(length, hq, hkv, d, seed=7, dtype=torch.float64)
    positions = torch.tensor(sorted(torch.randperm(length, generator=torch.Generator().manual_seed(2))[:60].tolist()))
    g = torch.Generator().manual_seed(3)
    sel = torch.full((60, hkv, 6), -1, dtype=torch.long)
    for i, t in enumerate(positions.tolist()):
        for h in range(hkv):
            own = torch.randperm(t // 16 + 1, generator=g)[: int(torch.randint(0, 7, (1,), generator=g))]
            sel[i, h, : own.numel()] = own.sort().values
    sel[5] = -1  # a row with no key in any head
    sel[9, 0] = -1  # and one head of another row
    results = both_paths(q[: len(positions)], k, v, cis, sel, positions, cfg, 0.3)
    assert_paths_agree(results, atol=1e-12, rtol=1e-10)
    out_m, grads_m = results[1]
    assert (out_m[5] == 0).all() and (out_m[9, :2] == 0).all() and (grads_m[0][5] == 0).all()
    assert (out_m[9, 2:] != 0).any()


@pytest.mark.parametrize("dense_len", [0, 70])
def test_nosa_prefill_training_step_equals_the_gathered_path(dense_len, monkeypatch):
    """Through nosa_prefill and nosa_prefill_varlen with an eviction head, as training runs them:
    the same loss gradients for q, k, v and the head's W, b, A with either path forced."""
    cfg = NosaConfig.tiny(dense_len=dense_len)
    length, hq, hkv, d = 200, 4, 2, 8
    q, k, v, _ = make(length, hq, hkv, d, seed=11)
    torch.manual_seed(0)
    head = EvictionHead(hkv, d)
    with torch.no_grad():
        head.scale.fill_(0.6)
    cu = torch.tensor([0, 90, 200])
    grads = {}
    for path, limit in (("gathered", 0.0), ("masked", 1e9)):
        monkeypatch.setattr(masked, "MASKED_KEYS_PER_BUDGET_TRAIN", limit)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        head.zero_grad()
        out = nosa_prefill(*leaves, head(leaves[2]), cfg, 0.35)[0]
        packed = nosa_prefill_varlen(*leaves, head(leaves[2]), cu, cfg, 0.35)[0]
        (out.square().sum() + packed.sin().sum()).backward()
        grads[path] = [t.grad for t in leaves] + [p.grad.clone() for p in head.parameters()]
    for name, a, b in zip(["q", "k", "v", "W", "b", "A"], grads["masked"], grads["gathered"]):
        torch.testing.assert_close(a, b, atol=5e-5, rtol=1e-4, msg=name)


def test_masked_path_keeps_the_input_dtype():
    cfg = NosaConfig.tiny()
    q, k, v, cis = (t.bfloat16() for t in make(100, 4, 2, 8, seed=5))
    out, sel = nosa_prefill(q, k, v, cis, cfg, 0.35)
    ref = attend_grouped(q, k, v, cis, sel, torch.arange(100), cfg, 0.35)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_dispatch_follows_the_context_against_the_budget(monkeypatch):
    """Short contexts (training at a few budgets) take the masked path, long ones the gathered
    path; with gradients the masks kept for backward bound it too."""
    cfg = NosaConfig.tiny()  # budget 8 blocks of 16 = 128 tokens
    assert use_masked(torch.arange(512), 2, cfg, training=True)
    assert not use_masked(torch.arange(4096), 2, cfg, training=True)
    assert use_masked(torch.arange(100, 140), 2, cfg, training=False)  # without gradients: up to 1.25 budgets
    assert not use_masked(torch.arange(300, 500), 2, cfg, training=False)
    monkeypatch.setattr(masked, "MASKED_SAVE_ELEMENTS", 1000)
    assert not use_masked(torch.arange(512), 2, cfg, training=True)
    calls = []
    monkeypatch.setattr(gathered, "attend_grouped", lambda *a, **kw: calls.append("gathered") or a[0])
    monkeypatch.setattr(masked, "attend_masked", lambda *a, **kw: calls.append("masked") or a[0])
    q, k, v, cis = make(300, 4, 2, 8, seed=0)
    nosa_prefill(q, k, v, cis, cfg, 0.35)
    nosa_prefill(q, k, v, cis.requires_grad_(), cfg, 0.35)
    assert calls == ["masked", "gathered"]  # inference within 1.25 budgets; training over the saved-mask bound


@pytest.mark.parametrize("length", [1, 9, 16, 17, 40])
def test_masked_equals_gathered_on_contexts_of_a_block_or_two(length):
    """Short documents (packed training rows, the first tokens of a prompt): one or two blocks."""
    cfg = NosaConfig.tiny(topk_blocks=5, query_blocks=2)
    q, k, v, cis = make(length, 4, 2, 8, seed=length)
    _, sel = nosa_prefill(q, k, v, cis, cfg, 0.35)
    assert_paths_agree(both_paths(q, k, v, cis, sel, torch.arange(length), cfg, 0.35), atol=2e-5, rtol=1e-4)
