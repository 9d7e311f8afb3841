"""The FlashInfer option of the slot decode (nosa.kernels.flashinfer_decode), on CPU: the folded page
table (KV heads folded into the batch, one page per slot) read by a torch model of FlashInfer's
paged decode gives the spec's attention (slot_decode_reference); the log2 -> natural lse conversion;
the dispatch (NOSA_DECODE_IMPL) and its errors; flashinfer never imported on CPU. The FlashInfer
kernel itself runs in tests/test_kernels_gpu.py (marked gpu)."""

import re
import sys

import pytest
import torch

from nosa import ops
from nosa.kernels import flashinfer_decode as fd
from nosa.kernels.slot_decode import slot_decode_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def case(rows, hq, hkv, d, block, ns, dtype, seed, unused=2, empty_row=False):
    """Shuffled slots of a cache with spare items; per (request, KV head) a partial tail block in a
    random position, some -1 slots and some fill-0 slots; optionally a KV head with no valid slot."""
    g = torch.Generator().manual_seed(seed)
    total = rows * hkv * ns
    cache = total + 7
    k, v = torch.randn(cache, block, d, generator=g), torch.randn(cache, block, d, generator=g)
    cis = torch.randn(cache, block, generator=g) * 0.7
    slots = torch.randperm(cache, generator=g)[:total].view(rows, hkv, ns).clone()
    fill = torch.full((rows, hkv, ns), block, dtype=torch.int32)
    tail = torch.randint(0, ns, (rows, hkv), generator=g)
    fill.scatter_(2, tail[..., None], torch.randint(1, block + 1, (rows, hkv, 1), generator=g, dtype=torch.int32))
    slots.view(-1)[torch.randperm(total, generator=g)[:unused]] = -1
    fill.view(-1)[torch.randperm(total, generator=g)[:unused]] = 0
    if empty_row:
        slots[-1, 0] = -1
    q = torch.randn(rows, hq, d, generator=g)
    return dict(q=q.to(dtype), k_dev=k.to(dtype), v_dev=v.to(dtype), cis_dev=cis, slots=slots, fill=fill)


CASES = [  # rows, hq, hkv, d, block, ns
    (3, 8, 2, 16, 16, 7),   # GQA 4
    (2, 6, 3, 8, 8, 9),     # GQA 2, 3 KV heads
    (1, 4, 4, 32, 64, 4),   # MHA, one request
    (4, 6, 1, 16, 8, 5),    # GQA 6, one KV head
]


@pytest.mark.parametrize("rows, hq, hkv, d, block, ns", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_folded_page_table_gives_the_spec(rows, hq, hkv, d, block, ns, dtype):
    c = case(rows, hq, hkv, d, block, ns, dtype, seed=rows * 10 + ns, empty_row=rows > 1)
    scale = d**-0.5
    want, want_lse = slot_decode_reference(**c, scale=scale)
    pages = fd.fold(**c)
    out, lse = fd.unfold(*fd.paged_decode_reference(pages, scale), rows, hq)
    assert out.dtype == dtype and lse.dtype == torch.float32 and out.shape == want.shape
    assert rel(out, want) < TOL[dtype]
    torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)  # includes -inf where a head is empty
    if rows > 1:
        g = hq // hkv
        assert torch.all(out[-1, :g] == 0) and torch.all(lse[-1, :g] == float("-inf"))
    # one block less must show: drop the first used slot of request 0, KV head 0
    dropped = dict(c, slots=c["slots"].clone())
    first = int((c["slots"][0, 0] >= 0).nonzero()[0])
    dropped["slots"][0, 0, first] = -1
    assert rel(fd.unfold(*fd.paged_decode_reference(fd.fold(**dropped), scale), rows, hq)[0], want) > 5 * TOL[dtype]


def test_page_table_layout():
    """Static shapes (indptr b * NS, full last pages), pages = slots of one KV head, -1 -> page 0 with
    fill 0, q and the caches viewed, not copied."""
    rows, hq, hkv, d, block, ns = 2, 8, 2, 16, 16, 5
    c = case(rows, hq, hkv, d, block, ns, torch.bfloat16, seed=1)
    pages = fd.fold(**c)
    assert pages.rows == rows * hkv and pages.q.shape == (rows * hkv, hq // hkv, d)
    assert torch.equal(pages.indptr, torch.arange(rows * hkv + 1, dtype=torch.int32) * ns)
    assert torch.equal(pages.last_page_len, torch.full((rows * hkv,), block, dtype=torch.int32))
    assert pages.indices.dtype == torch.int32 and pages.page_fill.dtype == torch.int32
    flat, fills = c["slots"].view(-1), c["fill"].view(-1)
    assert torch.equal(pages.indices.long(), flat.clamp(min=0))
    assert torch.equal(pages.page_fill, torch.where(flat >= 0, fills, 0))
    assert pages.k_pages.shape == (c["k_dev"].shape[0], block, 1, d)
    for view, base in ((pages.q, c["q"]), (pages.k_pages, c["k_dev"]), (pages.v_pages, c["v_dev"]),
                       (pages.cis, c["cis_dev"])):
        assert view.data_ptr() == base.data_ptr()
    # row b = (request b // Hkv, KV head b % Hkv) with that head's G query heads
    assert torch.equal(pages.q[3], c["q"][1, 4:8])


def test_unfold_converts_log2_lse():
    out = torch.randn(4, 2, 8)
    lse2 = torch.tensor([[1.0, -2.0], [float("-inf"), float("-inf")], [0.5, 3.0], [float("nan"), 0.0]])
    o, lse = fd.unfold(out, lse2, 2, 4)
    torch.testing.assert_close(lse[0, :2], torch.tensor([1.0, -2.0]) * fd.LN2)
    assert torch.all(lse[0, 2:] == float("-inf")) and torch.all(o[0, 2:] == 0)
    assert lse[1, 2] == float("-inf") and torch.all(o[1, 2] == 0) and torch.equal(o[1, 3], out[3, 1])


def test_variant_declaration_matches_jit_args():
    """The C++ variant reads exactly the extra tensors and scalars the jit_args declare, in the
    argument order gen_customize_batch_decode_module takes (FlashInfer 0.7.2)."""
    args = fd.jit_args(torch.bfloat16, 128)
    assert len(args) == 13 and args[1:5] == (torch.bfloat16, torch.bfloat16, torch.bfloat16, torch.int32)
    assert args[5] == args[6] == 128 and args[11] == fd.VARIANT_NAME and args[12] == fd.VARIANT_DECL
    assert args[7] == ["nosa_cis", "nosa_fill"] and args[9] == ["sm_scale"]
    used = set(re.findall(r"params\.(\w+)", fd.VARIANT_DECL))
    assert used == set(args[7]) | set(args[9]) | {"paged_kv", "get_kv_len"}
    assert f"struct {fd.VARIANT_NAME} : AttentionVariantBase" in fd.VARIANT_DECL
    assert fd.jit_args(torch.float16, 64)[0] != args[0]  # one JIT module per dtype and head dim


def test_dispatch_and_errors(monkeypatch):
    c = case(2, 4, 2, 16, 16, 3, torch.float32, seed=2)
    want = slot_decode_reference(**c, scale=0.25)
    monkeypatch.delenv("NOSA_KERNELS", raising=False)
    monkeypatch.delenv("NOSA_DECODE_IMPL", raising=False)
    assert ops.decode_impl() == "triton"
    torch.testing.assert_close(ops.slot_decode(**c, scale=0.25)[0], want[0])  # CPU: the reference
    monkeypatch.setenv("NOSA_DECODE_IMPL", "flashinfer")
    half = dict(c, q=c["q"].bfloat16(), k_dev=c["k_dev"].bfloat16(), v_dev=c["v_dev"].bfloat16())
    with pytest.raises(ValueError, match="runs on CUDA tensors only"):
        ops.slot_decode(**half, scale=0.25)
    monkeypatch.setenv("NOSA_KERNELS", "reference")  # the explicit rule-out still wins
    torch.testing.assert_close(ops.slot_decode(**c, scale=0.25)[0], want[0])
    monkeypatch.setenv("NOSA_DECODE_IMPL", "cutlass")
    with pytest.raises(ValueError, match="NOSA_DECODE_IMPL must be one of"):
        ops.decode_impl()
    with pytest.raises(ValueError, match="supports .*bfloat16.*got torch.float32"):
        fd.check_supported(c["q"], c["k_dev"])
    with pytest.raises(ValueError, match="runs on CUDA tensors only"):
        fd.check_supported(c["q"].bfloat16(), c["k_dev"].bfloat16())
    with pytest.raises(ValueError, match="must be contiguous"):
        fd.fold(**dict(c, k_dev=c["k_dev"].transpose(0, 1).contiguous().transpose(0, 1)))
    with pytest.raises(ValueError, match="int64"):
        fd.fold(**dict(c, slots=c["slots"].int()))


def test_flashinfer_never_imported_on_cpu():
    if "flashinfer" in sys.modules:
        pytest.skip("flashinfer was imported by something else in this process")
    c = case(2, 4, 2, 16, 16, 3, torch.bfloat16, seed=3)
    fd.unfold(*fd.paged_decode_reference(fd.fold(**c), 0.25), 2, 4)
    ops.slot_decode(**c, scale=0.25)
    assert "flashinfer" not in sys.modules
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="pip install flashinfer-python"):
            fd.require_flashinfer()


class FakeWrapper:
    """Stands in for flashinfer.BatchDecodeWithPagedKVCacheWrapper (0.7.2 signature) on CPU: in
    CUDA-graph mode FlashInfer's run() reads the page table from the buffers given at construction,
    not from what plan() was called with, so this one does too (through paged_decode_reference)."""

    plans = 0

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None, paged_kv_last_page_len_buffer=None,
                 backend="auto", jit_args=None):
        assert kv_layout == "NHD" and use_cuda_graph and backend == "fa2" and len(jit_args) == 13
        self.buffers = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        self.extra = jit_args[7] + jit_args[9]

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, *,
             q_data_type, kv_data_type):
        assert indptr.device.type == "cpu" and last_page_len.device.type == "cpu"  # plan reads them on the host
        assert num_kv_heads == 1 and torch.equal(indptr, self.buffers[0].cpu())
        assert len(indices) <= len(self.buffers[1]) and q_data_type == kv_data_type == torch.bfloat16
        FakeWrapper.plans += 1

    def run(self, q, kv, *args, return_lse=False):
        cis, fill, scale = args
        assert len(args) == len(self.extra) and isinstance(scale, float) and return_lse
        indptr, indices, last = self.buffers
        pages = fd.FoldedPages(q, kv[0], kv[1], cis, indptr.cpu(), indices, last.cpu(), fill, 0, 0, 0)
        return fd.paged_decode_reference(pages, scale)


def test_planned_wrapper_reuses_its_buffers(monkeypatch):
    """slot_decode_flashinfer's plumbing with a stand-in wrapper: one plan per batch shape, the new
    slot indices and fills copied into the planned buffers before each run, extra arguments in the
    declared order, the result equal to the spec."""
    fake = type("flashinfer", (), {"BatchDecodeWithPagedKVCacheWrapper": FakeWrapper})
    monkeypatch.setattr(fd, "require_flashinfer", lambda: fake)
    monkeypatch.setattr(fd, "check_supported", lambda q, k: None)
    monkeypatch.setattr(fd, "_PLANS", type(fd._PLANS)())
    FakeWrapper.plans = 0
    for seed, shape in enumerate([(3, 8, 2, 16, 16, 7), (3, 8, 2, 16, 16, 7), (2, 6, 3, 8, 8, 9)]):
        c = case(*shape, torch.bfloat16, seed=seed + 20)
        out, lse = fd.slot_decode_flashinfer(**c, scale=0.3)
        want, want_lse = slot_decode_reference(**c, scale=0.3)
        assert rel(out, want) < TOL[torch.bfloat16]
        torch.testing.assert_close(lse, want_lse, atol=1e-4, rtol=1e-5)
    assert FakeWrapper.plans == 2 and len(fd._PLANS) == 2
