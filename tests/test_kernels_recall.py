"""Recall gather-scatter (nosa.kernels.recall): the CPU path and the Triton kernel against a plain loop.

The kernel runs under TRITON_INTERPRET=1 without CUDA (conftest.py), for real with it."""

import pytest
import torch

from nosa import ops
from nosa.kernels import resolve_cpu
from nosa.kernels.recall import ItemCopier, copy_items_reference, copy_items_triton, item_rows

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pools(pages, hkv, block, d, slots, dtype, seed=0):
    """Host pool [P, Hkv, B, D] seen as items [P*Hkv, B, D], and an empty device cache of S slots."""
    g = torch.Generator().manual_seed(seed)
    host = (torch.randn(pages, hkv, block, d, generator=g).to(dtype),
            torch.randn(pages, hkv, block, d, generator=g).to(dtype),
            torch.randn(pages, hkv, block, generator=g))
    dev = (torch.zeros(slots, block, d, dtype=dtype), torch.zeros(slots, block, d, dtype=dtype),
           torch.zeros(slots, block))
    return [t.to(DEVICE) for t in host], [t.to(DEVICE) for t in dev]


def as_items(host):
    return [t.view(t.shape[0] * t.shape[1], *t.shape[2:]) for t in host]


def loop_copy(dst, src, dst_idx, src_idx):
    """The spec: a plain Python loop over the index lists."""
    out = [t.clone() for t in dst]
    for d, s in zip(dst_idx.tolist(), src_idx.tolist()):
        if s >= 0:
            for o, x in zip(out, src):
                o[d] = x[s]
    return out


def indices(num_src, num_dst, m, pad, seed):
    g = torch.Generator().manual_seed(seed)
    src = torch.randperm(num_src, generator=g)[:m]
    dst = torch.randperm(num_dst, generator=g)[:m]
    src[torch.randperm(m, generator=g)[:pad]] = -1  # padding: its dst (anything, even -1) is ignored
    dst[src < 0] = torch.randint(-1, num_dst, (int((src < 0).sum()),), generator=g)
    return dst.to(DEVICE), src.to(DEVICE)


COPIES = {"cpu": lambda dst, src, d, s: copy_items_reference(dst, src, d, s) if DEVICE == "cpu" else None,
          "triton": copy_items_triton,
          # the C++ memcpy loop (kernels/resolve_cpu.cpp) that ops.copy_items runs on CPU
          "cpu_kernel": lambda dst, src, d, s: resolve_cpu.copy_items(list(dst), list(src), d, s)}


def _skip_off_device(impl):
    if impl.startswith("cpu") and DEVICE == "cuda":
        pytest.skip("the CPU path runs on CPU tensors")
    if impl == "cpu_kernel" and resolve_cpu.library() is None:
        pytest.skip("no C++ compiler: the CPU kernel cannot build")
SHAPES = [(6, 2, 16, 8, 10, 7, 2), (5, 3, 64, 32, 12, 12, 0), (6, 1, 8, 3, 5, 5, 5)]  # P, Hkv, B, D, S, M, pad


@pytest.mark.parametrize("impl", ["cpu", "cpu_kernel", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_recall_matches_loop(impl, dtype, shape):
    _skip_off_device(impl)
    pages, hkv, block, d, slots, m, pad = shape
    host, dev = pools(pages, hkv, block, d, slots, dtype)
    dst_idx, src_idx = indices(pages * hkv, slots, m, pad, seed=m)
    dev[0].fill_(7)  # untouched slots must keep their contents
    expect = loop_copy(dev, as_items(host), dst_idx, src_idx)
    COPIES[impl](dev, as_items(host), dst_idx, src_idx)
    for got, want in zip(dev, expect):
        assert torch.equal(got, want)


@pytest.mark.parametrize("impl", ["cpu", "cpu_kernel", "triton"])
def test_write_back_to_host(impl):
    """Completed blocks go device -> host through the same call (dst = host items)."""
    _skip_off_device(impl)
    host, dev = pools(4, 2, 16, 8, 6, torch.bfloat16, seed=1)
    for t in dev:
        t.normal_()
    dst_idx, src_idx = torch.tensor([5, 0, -1, 3], device=DEVICE), torch.tensor([2, 4, -1, 1], device=DEVICE)
    items = as_items(host)
    expect = loop_copy(items, dev, dst_idx, src_idx)
    COPIES[impl](items, dev, dst_idx, src_idx)
    for got, want in zip(items, expect):
        assert torch.equal(got, want)
    assert torch.equal(host[0][2, 1], dev[0][2])  # item 5 = page 2, head 1 <- slot 2


def test_dispatch_and_item_views():
    """ops.copy_items (on CPU the C++ kernel, else one staging copier per layout); the copier moves
    items as wide integers."""
    host, dev = pools(3, 2, 16, 8, 4, torch.bfloat16)
    assert item_rows(dev[0]).dtype == torch.int64
    assert item_rows(torch.zeros(4, 3, dtype=torch.uint8)).dtype == torch.uint8
    dst_idx, src_idx = torch.tensor([1, 3], device=DEVICE), torch.tensor([4, 0], device=DEVICE)
    expect = loop_copy(dev, as_items(host), dst_idx, src_idx)
    ops.copy_items(dev, as_items(host), dst_idx, src_idx)
    for got, want in zip(dev, expect):
        assert torch.equal(got, want)
    copier = ItemCopier(dev, chunk_bytes=1)  # one item per chunk: the chunk loop is exercised
    assert copier.chunk == 1
    dev2 = [torch.zeros_like(t) for t in dev]
    if DEVICE == "cpu":
        copier.copy(dev2, as_items(host), dst_idx, src_idx)
        for got, want in zip(dev2, expect):
            assert torch.equal(got[dst_idx], want[dst_idx])


def test_recall_rejects_bad_input():
    host, dev = pools(3, 2, 16, 8, 4, torch.bfloat16)
    items = as_items(host)
    idx = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="int64"):
        ops.copy_items(dev, items, idx.int(), idx)
    with pytest.raises(ValueError, match="item shape"):
        ops.copy_items(dev, [items[0][:, :8], items[1], items[2]], idx, idx)
    with pytest.raises(ValueError, match="dtype"):
        ops.copy_items(dev, [items[0].float(), items[1], items[2]], idx, idx)
    with pytest.raises(ValueError, match="contiguous"):
        ops.copy_items([dev[0].transpose(1, 2)], [items[0].transpose(1, 2)], idx, idx)
    if DEVICE == "cpu":  # index ranges are checked on the CPU path only (a GPU check would synchronise)
        with pytest.raises(ValueError, match="outside"):
            copy_items_reference(dev, items, torch.tensor([0, 4]), idx)


@pytest.mark.gpu
def test_recall_from_pinned_host_memory():
    """On CUDA the kernel reads a pinned host pool directly (UVA) and writes back into it."""
    host, dev = pools(8, 2, 64, 128, 10, torch.bfloat16)
    pinned = [t.cpu().pin_memory() for t in host]
    items = as_items(pinned)
    # padding is src -1 (its dst is never used); a real pair never has dst -1 (the loop spec would
    # wrap it to the last slot, the kernel would write before the tensor)
    dst_idx = torch.tensor([4, 0, 9, 2, -1], device="cuda")
    src_idx = torch.tensor([15, 3, -1, 8, -1], device="cuda")
    expect = loop_copy([t.cpu() for t in dev], items, dst_idx.cpu(), src_idx.cpu())
    copy_items_triton(dev, items, dst_idx, src_idx)
    torch.cuda.synchronize()
    for got, want in zip(dev, expect):
        assert torch.equal(got.cpu(), want)
    back = [torch.zeros_like(t).pin_memory() for t in items]
    # write-back: device slots 4, 0, 2 -> pinned host items 15, 3, 8 (padded to a fixed length)
    to_host, from_dev = torch.tensor([15, 3, 8, -1], device="cuda"), torch.tensor([4, 0, 2, -1], device="cuda")
    copy_items_triton(back, dev, to_host, from_dev)
    torch.cuda.synchronize()
    assert torch.equal(back[0][15], items[0][15]) and torch.equal(back[2][8], items[2][8])
    copy_items_triton(back, dev, to_host.cpu(), from_dev.cpu())  # host index lists are moved to the GPU
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="pageable"):
        copy_items_triton(dev, [t.clone() for t in items], dst_idx, src_idx)  # clone() is not pinned
