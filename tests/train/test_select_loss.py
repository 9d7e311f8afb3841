"""The selection loss (nosa.train.select_loss): its dense target against a per-row softmax written
out, its rows, its documents, and that minimising it moves the query-aware pick (nosa.select, the
selection the server runs) onto the block the dense attention looks at."""

import dataclasses

import pytest
import torch

from nosa.compress import compress_windows
from nosa.config import NosaConfig
from nosa.select import query_block_scores, select_blocks
from nosa.train.select_loss import dense_block_mass, loss_rows, selection_kl, selection_loss

CFG = NosaConfig(block_size=16, compress_kernel=16, compress_stride=8, sink_blocks=1, window_blocks=2,
                 query_blocks=1, topk_blocks=4, dense_len=0)


def test_dense_block_mass_is_each_rows_causal_softmax_summed_per_block():
    torch.manual_seed(0)
    length, hq, hkv, d = 70, 4, 2, 8
    q, k = torch.randn(5, hq, d), torch.randn(length, hkv, d)
    positions = torch.tensor([3, 17, 40, 63, 69])
    nb = CFG.num_blocks(length)
    got = dense_block_mass(q, k, positions, nb, CFG, 0.3)
    for r, t in enumerate(positions.tolist()):
        for kv in range(hkv):  # query heads 2 kv and 2 kv + 1 read KV head kv
            want = torch.zeros(nb)
            for h in (2 * kv, 2 * kv + 1):
                p = torch.softmax(0.3 * k[: t + 1, kv] @ q[r, h], dim=0)
                want += torch.zeros(nb).index_add_(0, torch.arange(t + 1) // 16, p) / 2
            torch.testing.assert_close(got[r, kv], want, atol=1e-6, rtol=1e-5)


def test_loss_rows_take_the_answer_rows_first_and_only_rows_with_a_choice():
    length = 180
    position_ids = torch.cat([torch.arange(90), torch.arange(90)])  # two documents
    weights = torch.ones(length)
    weights[:10] = 0
    answers = torch.zeros(length, dtype=torch.bool)
    answers[[70, 80, 170]] = True  # rows 69, 79 and 169 predict them
    gen = torch.Generator().manual_seed(0)
    rows = loss_rows(weights, answers, position_ids, CFG, 5, gen)
    assert rows.tolist() == sorted(rows.tolist()) and len(rows) == 5
    assert {69, 79, 169} <= set(rows.tolist())
    # a row has two candidates (blocks 1 and 2) once its block is past the sink, those and the
    # window: position >= 4 * 16; at 48..63 block 1 alone is a candidate, and the KL over it is 0
    assert all(int(position_ids[r]) >= 64 and weights[r] > 0 for r in rows)
    assert len(loss_rows(weights, answers, position_ids, CFG, 100, gen)) == 2 * (90 - 64)
    # every row a target (a prose row): a random subset of them, not the ones nearest the start
    everything = torch.ones(length, dtype=torch.bool)
    picks = [loss_rows(weights, everything, position_ids, CFG, 5, torch.Generator().manual_seed(s)) for s in range(4)]
    eligible = [r for r in range(length - 1) if int(position_ids[r]) >= 64]
    assert any(p.tolist() != eligible[:5] for p in picks) and len({tuple(p.tolist()) for p in picks}) > 1


def _needle_case(seed):
    """One query row at the end of a 160-token document: a needle key nearly parallel to the query
    in the second half of block 3 (the dense attention's largest candidate block), and a block of
    keys each a little aligned (block 6), which the compressed keys (window means, where the needle
    is diluted 16 times) score higher."""
    torch.manual_seed(seed)
    length, d = 160, 16
    q = torch.randn(1, 2, d)  # 2 query heads, 1 KV head
    k = torch.randn(length, 1, d) * 0.5
    u = q[0].mean(0)
    k[3 * 16 + 12, 0] = u * 2.5
    k[6 * 16 : 7 * 16, 0] += u * 0.3
    return q, k, torch.tensor([length - 1]), 3


@pytest.mark.parametrize("seed", [0, 3, 5])
def test_minimising_the_loss_moves_the_pick_onto_the_dense_attentions_block(seed):
    q, k, positions, needle = _needle_case(seed)
    nb = CFG.num_blocks(k.shape[0])
    scale = 0.25
    # candidates: blocks 1 .. nb - 3 (block 0 is the sink, the last two the window)
    assert int(dense_block_mass(q, k, positions, nb, CFG, scale)[0, 0, 1:-2].argmax()) + 1 == needle

    def pick(q, k):
        scores = query_block_scores(q, compress_windows(k, CFG), positions, nb, CFG, scale)
        evict_off = torch.zeros(1, 1, nb, 2)  # A = 0: the budget ranks by the query-aware score
        sel = select_blocks(scores, evict_off, positions, dataclass_one_pick())
        return set(sel[0, 0].tolist()) - {0, nb - 2, nb - 1}

    assert pick(q, k) == {6}  # the training-free score misses the needle
    q, k = q.clone().requires_grad_(True), k.clone().requires_grad_(True)
    first, _ = selection_kl(q, k, positions, CFG, scale)
    opt = torch.optim.Adam([q, k], lr=0.05)
    for _ in range(60):
        opt.zero_grad()
        loss, count = selection_kl(q, k, positions, CFG, scale)
        assert count == 1
        loss.backward()
        opt.step()
    last, _ = selection_kl(q, k, positions, CFG, scale)
    assert float(last.detach()) < float(first.detach())
    assert pick(q.detach(), k.detach()) == {needle}


def dataclass_one_pick():
    """CFG with a budget of the forced blocks plus one: the one free pick is the whole query-aware part."""
    return dataclasses.replace(CFG, topk_blocks=CFG.sink_blocks + CFG.window_blocks + 1)


def test_selection_kl_is_zero_without_candidates_and_nonnegative():
    torch.manual_seed(3)
    q, k = torch.randn(3, 2, 8, requires_grad=True), torch.randn(40, 1, 8)
    zero, count = selection_kl(q, k, torch.tensor([10, 20, 39]), CFG, 0.3)  # every block forced
    assert count == 0 and float(zero) == 0.0
    k = torch.randn(100, 1, 8)
    kl, count = selection_kl(q, k, torch.tensor([60, 80, 99]), CFG, 0.3)
    assert count == 3 and float(kl) > 0
    kl.backward()
    assert q.grad.abs().sum() > 0


def test_selection_loss_of_packed_documents_is_each_documents_own():
    """Rows of the second document see only its keys: the loss equals the per-document sum."""
    torch.manual_seed(4)
    length, hq, hkv, d = 180, 2, 1, 8
    q, k = torch.randn(1, length, hq, d), torch.randn(1, length, hkv, d)
    position_ids = torch.cat([torch.arange(80), torch.arange(100)])[None]
    labels = torch.ones(1, length, dtype=torch.long)
    answers = torch.zeros(1, length, dtype=torch.bool)

    class Attn(torch.nn.Module):
        _nosa_config, scaling = CFG, 0.3

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Attn()

    rows_gen = torch.Generator().manual_seed(0)
    got = selection_loss({"attn": (q, k, None)}, Model(), labels, answers, position_ids, 1.0, 1000, rows_gen)
    # every row with a choice of blocks (position >= 64) and a next token (all but the very last row)
    first, n1 = selection_kl(q[0, 64:80], k[0, :80], torch.arange(64, 80), CFG, 0.3)
    second, n2 = selection_kl(q[0, 144:179], k[0, 80:179], torch.arange(64, 99), CFG, 0.3)
    assert n1 == 16 and n2 == 35
    torch.testing.assert_close(got, (first + second) / (n1 + n2))


def test_the_loss_of_a_nosa_model_reaches_its_queries_and_keys():
    """capture_attention_inputs(batch_row=None, detach=False) keeps the graph: the loss reaches
    q_proj and k_proj of every layer (the score is q . compressed keys), and not the last layer's
    v_proj (its values feed no later query or key)."""
    import nosa
    from nosa.hf import capture_attention_inputs
    from nosa.tiny import build_causal_lm

    model = nosa.convert(build_causal_lm("llama", seed=0, vocab_size=96, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=2048), NosaConfig.tiny())
    ids = torch.randint(3, 96, (2, 200))
    position_ids = torch.arange(200).expand(2, 200)
    with capture_attention_inputs(model, batch_row=None, detach=False) as captured:
        model(input_ids=ids, position_ids=position_ids, use_cache=False)
    q, k, _ = captured["model.layers.0.self_attn"]
    assert q.shape[:2] == (2, 200) and k.shape[:2] == (2, 200) and q.requires_grad
    labels = torch.ones(2, 200, dtype=torch.long)
    loss = selection_loss(captured, model, labels, torch.zeros(2, 200, dtype=torch.bool), position_ids, 1.0, 16,
                          torch.Generator().manual_seed(0))
    assert float(loss) > 0
    loss.backward()
    for layer in model.model.layers:
        attn = layer.self_attn
        assert attn.q_proj.weight.grad.abs().sum() > 0 and attn.k_proj.weight.grad.abs().sum() > 0
    last = model.model.layers[-1].self_attn.v_proj.weight.grad  # earlier layers' v feed later q and k
    assert last is None or last.abs().sum() == 0
