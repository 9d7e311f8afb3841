"""The kernels at the project's shapes on a real GPU (marked gpu: skipped without CUDA).

The CPU tests run the kernels through the interpreter at small shapes with fp32 dot products;
these run what a GPU serves and trains with (Llama-3-8B heads: bf16, D 128, blocks of 64, top-k 64,
G 4): the tensor-core path, large tiles, the split-K decode, recall of 16 KiB items from pinned
host memory, all against the torch reference on the same inputs."""

import pytest
import torch

from nosa import ops
from nosa.kernels.recall import copy_items_triton
from nosa.kernels.slot_decode import slot_decode, slot_decode_reference
from nosa.kernels.sparse_prefill import sparse_prefill, sparse_prefill_reference

pytestmark = pytest.mark.gpu


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("rows, splits", [(4, None), (16, 1), (2, 8)])
def test_slot_decode_llama_shape(rows, splits):
    hq, hkv, d, block, ns = 32, 8, 128, 64, 65
    torch.manual_seed(rows)
    total = rows * hkv * ns
    q = torch.randn(rows, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total + 3, block, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cis = torch.randn(total + 3, block, device="cuda") * 0.5
    slots = torch.randperm(total + 3, device="cuda")[:total].view(rows, hkv, ns)
    fill = torch.full((rows, hkv, ns), block, dtype=torch.int32, device="cuda")
    fill[..., -1] = 17
    slots[0, 0, 5] = -1
    out, lse = slot_decode(q, k, v, cis, slots, fill, d**-0.5, num_splits=splits)
    ref, ref_lse = slot_decode_reference(q, k, v, cis, slots, fill, d**-0.5)
    assert rel(out, ref) < 1e-2
    torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=1e-3)


def test_sparse_prefill_llama_shape_forward_backward():
    hq, hkv, d, block, topk, length, n = 32, 8, 128, 64, 64, 8192, 128
    torch.manual_seed(0)
    q = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(length, hkv, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cis = torch.randn(length, hkv, device="cuda") * 0.3
    positions = torch.arange(length - n, length, device="cuda")
    cur = positions // block
    others = torch.stack([torch.randperm(int(cur[0]) - 1, device="cuda")[: topk - 2] + 1 for _ in range(hkv)])
    sel = torch.cat([torch.zeros(n, hkv, 1, device="cuda", dtype=torch.long), others[None].expand(n, -1, -1),
                     cur[:, None, None].expand(n, hkv, 1)], -1)
    sel[::3, :, 10] = -1  # rows that differ
    dout = torch.randn(n, hq, d, device="cuda", dtype=torch.bfloat16)
    inputs = [t.clone().requires_grad_() for t in (q, k, v, cis)]
    out, lse = sparse_prefill(*inputs, sel, positions, block, d**-0.5)
    out.backward(dout)
    ref_inputs = [t.float().requires_grad_() for t in (q, k, v, cis)]
    ref, ref_lse = sparse_prefill_reference(*ref_inputs, sel, positions, block, d**-0.5)
    ref.backward(dout.float())
    assert rel(out, ref) < 2e-2 and rel(lse, ref_lse) < 1e-3
    for name, a, b in zip("q k v cis".split(), inputs, ref_inputs):
        assert rel(a.grad, b.grad) < 4e-2, name


def test_recall_llama_items_from_pinned_host():
    pages, hkv, block, d, slots, m = 64, 8, 64, 128, 256, 300
    g = torch.Generator().manual_seed(0)
    host = [torch.randn(pages * hkv, block, d, generator=g).bfloat16().pin_memory(),
            torch.randn(pages * hkv, block, d, generator=g).bfloat16().pin_memory(),
            torch.randn(pages * hkv, block, generator=g).pin_memory()]
    dev = [torch.zeros(slots, *t.shape[1:], dtype=t.dtype, device="cuda") for t in host]
    src = torch.randperm(pages * hkv, generator=g)[:m]
    dst = torch.cat([torch.randperm(slots, generator=g), torch.full((m - slots,), -1)])
    src[slots:] = -1  # padding
    ops.copy_items(dev, host, dst.cuda(), src.cuda())
    torch.cuda.synchronize()
    keep = src >= 0
    for d_t, h_t in zip(dev, host):
        assert torch.equal(d_t[dst[keep]].cpu(), h_t[src[keep]])
    back = [torch.zeros_like(t).pin_memory() for t in host]
    copy_items_triton(back, dev, src.cuda(), dst.cuda())  # write-back: slot dst[m] -> host item src[m]
    torch.cuda.synchronize()
    for b_t, h_t in zip(back, host):
        assert torch.equal(b_t[src[keep]], h_t[src[keep]])


def test_decode_step_is_cuda_graph_capturable():
    """Recall + slot decode with static shapes and no host synchronisation: one CUDA graph replays
    a decode step after the index lists and slot tables change in place (the capture path the
    serving backend aims for)."""
    rows, hq, hkv, d, block, ns, pages = 4, 32, 8, 128, 64, 9, 40
    torch.manual_seed(1)
    host = [torch.randn(pages * hkv, block, d).bfloat16().pin_memory(),
            torch.randn(pages * hkv, block, d).bfloat16().pin_memory(), torch.randn(pages * hkv, block).pin_memory()]
    slots_total = rows * hkv * ns
    dev = [torch.zeros(slots_total, *t.shape[1:], dtype=t.dtype, device="cuda") for t in host]
    q = torch.randn(rows, hq, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(slots_total, device="cuda").view(rows, hkv, ns)
    fill = torch.full((rows, hkv, ns), block, dtype=torch.int32, device="cuda")
    dst = torch.full((64,), -1, dtype=torch.long, device="cuda")
    src = torch.full((64,), -1, dtype=torch.long, device="cuda")

    def step():
        ops.copy_items(dev, host, dst, src)
        return ops.slot_decode(q, *dev, slots, fill, d**-0.5)

    step()  # compile the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for seed in range(2):
        g = torch.Generator().manual_seed(seed)
        dst.copy_(torch.randperm(slots_total, generator=g)[:64])
        src.copy_(torch.randperm(pages * hkv, generator=g)[:64])
        src[::5] = -1
        slots.copy_(torch.randperm(slots_total, generator=g).view(rows, hkv, ns))
        graph.replay()
        torch.cuda.synchronize()
        eager = [t.clone() for t in dev]
        ref, ref_lse = slot_decode_reference(q, *eager, slots, fill, d**-0.5)
        keep = (src >= 0).cpu()
        assert torch.equal(eager[0][dst[src >= 0]].cpu(), host[0][src.cpu()[keep]])
        assert rel(out, ref) < 1e-2
        torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=1e-3)




@pytest.mark.parametrize("rows", [4, 16])
def test_flashinfer_slot_decode_llama_shape(rows, monkeypatch):
    """The FlashInfer option (NOSA_DECODE_IMPL=flashinfer) against the reference: bf16, Llama-3-8B
    heads, a partial tail block, an unused slot, an empty (request, KV head); a second call with new
    slot tables reuses the plan (only the indices change on the device) and must still be right."""
    pytest.importorskip("flashinfer")
    from nosa.kernels.flashinfer_decode import slot_decode_flashinfer

    hq, hkv, d, block, ns = 32, 8, 128, 64, 65
    torch.manual_seed(rows + 7)
    total = rows * hkv * ns
    q = torch.randn(rows, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total + 3, block, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cis = torch.randn(total + 3, block, device="cuda") * 0.5
    fill = torch.full((rows, hkv, ns), block, dtype=torch.int32, device="cuda")
    fill[..., 7] = 23  # the tail block need not be the last slot
    fill[1, 2, 3] = 0
    for seed in range(2):
        slots = torch.randperm(total + 3, device="cuda")[:total].view(rows, hkv, ns)
        slots[0, 0, 5] = -1
        slots[rows - 1, hkv - 1] = -1  # a KV head with nothing to attend to
        out, lse = slot_decode_flashinfer(q, k, v, cis, slots, fill, d**-0.5)
        ref, ref_lse = slot_decode_reference(q, k, v, cis, slots, fill, d**-0.5)
        assert rel(out, ref) < 1e-2, seed
        torch.testing.assert_close(lse, ref_lse, atol=2e-2, rtol=1e-3)
        assert torch.all(out[rows - 1, -4:] == 0) and torch.all(lse[rows - 1, -4:] == float("-inf"))
    monkeypatch.setenv("NOSA_DECODE_IMPL", "flashinfer")
    via_ops, _ = ops.slot_decode(q, k, v, cis, slots, fill, d**-0.5)
    assert torch.equal(via_ops, out)
