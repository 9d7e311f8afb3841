"""nosa.ops dispatch: NOSA_KERNELS picks the Triton kernel or the torch reference, and both give the
same results; nosa_prefill (the training path) through the kernel equals the reference path,
forward and backward. Without CUDA the kernels run under TRITON_INTERPRET=1 (conftest.py)."""

import pytest
import torch

from nosa import NosaConfig, nosa_prefill, ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_backend_choice(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.delenv("NOSA_KERNELS", raising=False)
    assert ops.backend(cpu) == "reference"
    monkeypatch.setenv("NOSA_KERNELS", "reference")
    assert ops.backend(cpu) == "reference"
    monkeypatch.setenv("NOSA_KERNELS", "triton")
    assert ops.backend(torch.zeros(1, device=DEVICE)) == "triton"  # CPU: through the interpreter
    monkeypatch.setenv("NOSA_KERNELS", "fast")
    with pytest.raises(ValueError, match="NOSA_KERNELS must be one of"):
        ops.backend(cpu)
    monkeypatch.setenv("NOSA_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        ops.backend(cpu)
    monkeypatch.delenv("NOSA_KERNELS")
    if torch.cuda.is_available():
        assert ops.backend(cpu.cuda()) == "triton" and ops.use_kernels(cpu, cpu.cuda())


def both(monkeypatch, fn):
    """fn() under NOSA_KERNELS=reference and =triton."""
    results = []
    for choice in ("reference", "triton"):
        monkeypatch.setenv("NOSA_KERNELS", choice)
        results.append(fn())
    return results


def test_ops_decode_paths_agree(monkeypatch):
    g = torch.Generator().manual_seed(0)
    rows, hq, hkv, d, block, ns = 2, 4, 2, 16, 16, 5
    q = torch.randn(rows, hq, d, generator=g).to(DEVICE)
    k_dev, v_dev = (torch.randn(20, block, d, generator=g).to(DEVICE) for _ in range(2))
    cis_dev = torch.randn(20, block, generator=g).to(DEVICE)
    slots = torch.randperm(20, generator=g)[: rows * hkv * ns].view(rows, hkv, ns).to(DEVICE)
    fill = torch.full((rows, hkv, ns), block, dtype=torch.int32, device=DEVICE)
    fill[..., -1] = 3
    (ref, ref_lse), (out, lse) = both(monkeypatch, lambda: ops.slot_decode(q, k_dev, v_dev, cis_dev, slots, fill, 0.25))
    assert rel(out, ref) < 1e-5 and (lse - ref_lse).abs().max() < 1e-4
    # the paged pool (offloading off): same values seen through a token table
    pool = 20 * block
    k_pool = k_dev.reshape(pool, 1, d).expand(pool, hkv, d).contiguous()
    v_pool = v_dev.reshape(pool, 1, d).expand(pool, hkv, d).contiguous()
    cis_pool = cis_dev.reshape(pool, 1).expand(pool, hkv).contiguous()
    table = torch.randperm(pool, generator=g)[:96].view(rows, 48).int().to(DEVICE)
    sel = torch.tensor([[[0, 2], [1, -1]], [[2, 1], [0, 2]]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([48, 40], dtype=torch.int32, device=DEVICE)
    (ref, ref_lse), (out, lse) = both(monkeypatch, lambda: ops.paged_sparse_decode(
        q, k_pool, v_pool, cis_pool, table, sel, lens, block, 0.25))
    assert rel(out, ref) < 1e-5 and (lse - ref_lse).abs().max() < 1e-4
    assert torch.isfinite(ref_lse).all()


def test_ops_copy_items_paths_agree(monkeypatch):
    g = torch.Generator().manual_seed(1)
    host = [torch.randn(12, 16, 8, generator=g).to(DEVICE), torch.randn(12, 16, generator=g).to(DEVICE)]
    dst_idx = torch.tensor([3, 0, -1, 7], device=DEVICE)  # a padded entry's dst is ignored
    src_idx = torch.tensor([11, 2, -1, 5], device=DEVICE)

    def run():
        dev = [torch.zeros(8, 16, 8, device=DEVICE), torch.zeros(8, 16, device=DEVICE)]
        ops.copy_items(dev, host, dst_idx, src_idx)
        return dev

    ref, out = both(monkeypatch, run)
    assert all(torch.equal(a, b) for a, b in zip(ref, out)) and torch.equal(ref[0][3], host[0][11])


@pytest.mark.parametrize("cfg, length", [(NosaConfig.tiny(), 96), (NosaConfig.tiny(dense_len=32), 80)])
def test_nosa_prefill_through_the_kernel(monkeypatch, cfg, length):
    """The training path: nosa_prefill with the Triton kernel (what CUDA runs) equals the reference
    path in output and in the gradients of q, k, v and cis."""
    from nosa.kernels import sparse_prefill as kernel

    launches = []
    real = kernel.sparse_prefill
    monkeypatch.setattr(kernel, "sparse_prefill", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    g = torch.Generator().manual_seed(2)
    tensors = [torch.randn(length, 4, 16, generator=g), torch.randn(length, 2, 16, generator=g),
               torch.randn(length, 2, 16, generator=g), torch.randn(length, 2, generator=g) * 0.5]
    dout = torch.randn(length, 4, 16, generator=g).to(DEVICE)

    def run():
        inputs = [t.to(DEVICE).requires_grad_() for t in tensors]
        out, sel = nosa_prefill(*inputs, cfg, 0.25)
        (out * dout).sum().backward()
        return out.detach(), sel, [t.grad for t in inputs]

    (ref, ref_sel, ref_grads), (out, sel, grads) = both(monkeypatch, run)
    assert launches == [1]  # the reference run did not launch it, the triton run did
    assert torch.equal(sel, ref_sel)
    assert rel(out, ref) < 1e-5
    for name, a, b in zip("q k v cis".split(), grads, ref_grads):
        assert rel(a, b) < 1e-4, name


def test_training_step_through_the_kernels(monkeypatch):
    """A tiny converted Llama (non-zero eviction heads): loss and every gradient of one training
    step are the same with the Triton kernels (through the interpreter on CPU) as with the reference."""
    transformers = pytest.importorskip("transformers")
    import nosa

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                                      max_position_embeddings=256)
    torch.manual_seed(0)
    model = nosa.convert(transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa"),
                         NosaConfig.tiny())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "nosa_evict" in name:
                p.copy_(torch.randn_like(p) * (0.5 if p.dim() else 1.0) + (0.7 if p.dim() == 0 else 0.0))
    model = model.to(DEVICE)
    ids = torch.randint(0, 97, (1, 48), generator=torch.Generator().manual_seed(1)).to(DEVICE)

    def step():
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    from nosa.kernels import sparse_prefill as kernel

    launches = []
    real = kernel.sparse_prefill
    monkeypatch.setattr(kernel, "sparse_prefill", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    (ref_loss, ref_grads), (loss, grads) = both(monkeypatch, step)
    assert len(launches) == 2  # one per layer, in the triton run only
    assert abs(loss.item() - ref_loss.item()) < 1e-5
    assert ref_grads.keys() == grads.keys() and any("nosa_evict" in n for n in grads)
    for name in ref_grads:
        assert rel(grads[name], ref_grads[name]) < 1e-4, name
