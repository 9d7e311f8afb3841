"""The pure-torch stand-in for sgl_kernel's CPU helpers (serve/tools/sgl_kernel_standin/sgl_kernel)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

PATH = os.path.join(os.path.dirname(__file__), "..", "..", "serve", "tools", "sgl_kernel_standin", "sgl_kernel",
                    "__init__.py")


@pytest.fixture(scope="module")
def standin():
    spec = importlib.util.spec_from_file_location("nosa_sgl_kernel_standin", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_assign_req_to_token_pool(standin):
    table = torch.zeros(4, 10, dtype=torch.int32)
    standin.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), table, torch.tensor([1, 0]), torch.tensor([3, 4]), torch.arange(100, 106), 10
    )
    assert table[2, 1:3].tolist() == [100, 101]
    assert table[0, :4].tolist() == [102, 103, 104, 105]
    assert int(table.count_nonzero()) == 6


def test_copy_all_layer_kv_cache_swaps_rows_in_place(standin):
    a = torch.arange(20, dtype=torch.float32).view(5, 4)
    b = torch.arange(10, dtype=torch.float16).view(5, 2)
    expected_a, expected_b = a.clone(), b.clone()
    expected_a[[0, 4]] = a[[4, 0]]
    expected_b[[0, 4]] = b[[4, 0]]
    ptrs = torch.tensor([a.data_ptr(), b.data_ptr()], dtype=torch.uint64)
    strides = torch.tensor([a.stride(0) * 4, b.stride(0) * 2])
    standin.copy_all_layer_kv_cache_cpu(ptrs, strides, torch.tensor([0, 4]), torch.tensor([4, 0]))
    assert torch.equal(a, expected_a) and torch.equal(b, expected_b)


def test_unsupported_helpers_name_themselves(standin):
    with pytest.raises(NotImplementedError, match="verify_tree_greedy_cpu"):
        standin.verify_tree_greedy_cpu()


def test_does_not_claim_amx(standin):
    # SGLang's cpu_has_amx_support() looks for this op; registering it would route norms and rope
    # to AMX kernels the stand-in does not have.
    assert not hasattr(torch.ops.sgl_kernel, "convert_weight_packed")


def test_declares_the_ops_the_cpu_graph_runner_registers_fakes_for(standin):
    """SGLang's CPU graph runner (--enable-torch-compile) registers fake implementations for these
    operators and fails at start-up when one does not exist; the stand-in declares every one."""
    for name in standin.GRAPH_RUNNER_OPS:
        assert hasattr(torch.ops.sgl_kernel, name), name
    assert "shm_allreduce" in standin.GRAPH_RUNNER_OPS and "rmsnorm_cpu" in standin.GRAPH_RUNNER_OPS
