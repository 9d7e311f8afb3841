"""Tensor parallelism without a server: the KV heads of each rank, the sharded eviction head against
the whole one (cis and the selection per KV head), the refused layouts, the per-rank stats file and
the CPU start-up hook.

Layouts (H real KV heads over N ranks): split (4 over 2), one each (2 over 2), replicated as on
GPU (2 over 4: two ranks per head, counted once), and padded as SGLang's CPU path does (1 real head
padded to 2, 3 real heads padded to 4).
"""

from __future__ import annotations

import os
import types

import pytest
import torch

from nosa.config import NosaConfig
from nosa.eviction import EvictionHead, block_eviction_scores
from nosa.select import select_blocks
from nosa.serve.parallel import KVHeadShard, check_layout, group_without_pynccl, rank_path
from nosa.serve.sharded_eviction import ShardedEvictionHead

D = 8
CFG = NosaConfig.tiny(dense_len=64)
# (total heads SGLang lays out, real heads, ranks)
LAYOUTS = [(4, 4, 2), (2, 2, 2), (2, 2, 4), (2, 1, 2), (4, 3, 2), (1, 1, 2)]


def _whole_head(real: int, seed: int = 0) -> EvictionHead:
    torch.manual_seed(seed)
    head = EvictionHead(real, D)
    with torch.no_grad():
        head.proj.weight.normal_(0, 0.3)
        head.proj.bias.normal_(0, 0.3)
        head.scale.uniform_(0.5, 1.5)
    return head.requires_grad_(False)


def _values(total: int, real: int, tokens: int = 300) -> torch.Tensor:
    """v [T, total, D]: SGLang's padding heads have zero V."""
    v = torch.randn(tokens, total, D)
    v[:, real:] = 0
    return v


def test_heads_follow_sglang_layout():
    # QKVParallelLinear: total >= ranks -> contiguous runs; fewer heads -> rank r holds head r // replicas
    assert [list(KVHeadShard(4, 4, r, 2).heads()) for r in range(2)] == [[0, 1], [2, 3]]
    assert [list(KVHeadShard(2, 2, r, 4).heads()) for r in range(4)] == [[0], [0], [1], [1]]
    assert [KVHeadShard(2, 2, r, 4).counts for r in range(4)] == [True, False, True, False]
    padded = [KVHeadShard(4, 3, r, 2) for r in range(2)]
    assert [s.real_heads() for s in padded] == [[0, 1], [2]] and padded[1].local == 2
    # communication only where a rank holds part of the real heads
    assert KVHeadShard(4, 4, 0, 2).communicates and KVHeadShard(2, 2, 0, 4).communicates
    assert not KVHeadShard(2, 1, 0, 2).communicates and not KVHeadShard(1, 1, 1, 2).communicates
    assert not KVHeadShard(2, 2, 0, 1).communicates
    with pytest.raises(ValueError, match="cannot be split"):
        KVHeadShard(3, 3, 0, 2)


def _sharded_cis(head: EvictionHead, v: torch.Tensor, total: int, real: int, size: int) -> list[torch.Tensor]:
    """Each rank's cis [T, local], with the all-reduce simulated: the sum of every rank's partial."""
    shards = [KVHeadShard(total, real, r, size) for r in range(size)]
    heads = [ShardedEvictionHead(head, s, all_reduce=lambda t: t) for s in shards]
    if not shards[0].communicates:
        return [h(v[:, list(s.heads())]) for h, s in zip(heads, shards)]
    summed = sum(h.partial(v[:, list(s.heads())]) for h, s in zip(heads, shards))
    return [h.finish(summed.clone()) for h in heads]


@pytest.mark.parametrize("total,real,size", LAYOUTS)
def test_sharded_cis_and_selection_equal_tp1(total, real, size):
    head = _whole_head(real)
    v = _values(total, real)
    want = head(v[:, :real])  # TP 1: [T, real]
    per_rank = _sharded_cis(head, v, total, real, size)
    for rank, cis in enumerate(per_rank):
        shard = KVHeadShard(total, real, rank, size)
        assert cis.shape == (v.shape[0], shard.local)
        for i, h in enumerate(shard.heads()):
            if h < real:  # every replica of a head gets the same cis
                torch.testing.assert_close(cis[:, i], want[:, h], rtol=1e-6, atol=1e-6)
            else:
                assert torch.all(cis[:, i] == 0), "a padding head gets cis 0"
    # the selection of each real KV head, from the rank that holds it, equals TP 1's
    got = torch.zeros_like(want)
    for rank, cis in enumerate(per_rank):
        for i, h in enumerate(KVHeadShard(total, real, rank, size).heads()):
            if h < real:
                got[:, h] = cis[:, i]
    positions = torch.tensor([150, 220, 299])
    g = torch.Generator().manual_seed(1)
    nb = CFG.num_blocks(v.shape[0])
    query = torch.randn(len(positions), real, nb, generator=g)
    pick = [select_blocks(query, block_eviction_scores(c, CFG, nb)[None], positions, CFG) for c in (want, got)]
    assert torch.equal(pick[0], pick[1])
    assert not torch.equal(pick[0], select_blocks(query, torch.zeros(1, real, nb, 2), positions, CFG)), \
        "the eviction scores must matter to the selection, or the test could not fail"


def test_one_rank_is_the_plain_eviction_head():
    head = _whole_head(2)
    v = _values(2, 2)
    # one rank holding every real head runs TP 1's own arithmetic: equal bit for bit
    assert torch.equal(ShardedEvictionHead(head, KVHeadShard(2, 2, 0, 1))(v), head(v))
    with pytest.raises(ValueError, match="needs an all_reduce"):
        ShardedEvictionHead(head, KVHeadShard(2, 2, 0, 2))
    with pytest.raises(ValueError, match="expects v"):
        ShardedEvictionHead(head, KVHeadShard(2, 2, 0, 2), all_reduce=lambda t: t)(v)


def _gloo_rank(rank: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        head = _whole_head(4, seed=5)
        v = _values(4, 4)  # same seed in both processes: the same tokens
        shard = KVHeadShard(4, 4, rank, 2)

        def all_reduce(t):
            dist.all_reduce(t)
            return t

        cis = ShardedEvictionHead(head, shard, all_reduce)(v[:, list(shard.heads())])
        torch.save(cis, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_processes_over_gloo_equal_tp1(tmp_path):
    """The real collective: two processes sum their partials with torch.distributed over gloo."""
    import torch.multiprocessing as mp

    from nosa.net import free_port

    mp.spawn(_gloo_rank, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    head = _whole_head(4, seed=5)
    want = head(_values(4, 4))  # drawn after the same seeding as the ranks drew theirs
    got = torch.cat([torch.load(tmp_path / f"rank{r}.pt") for r in range(2)], dim=1)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def _server_args(**overrides):
    args = dict(tp_size=2, pp_size=1, attn_cp_size=1, dcp_size=1, enable_dp_attention=False)
    return types.SimpleNamespace(**{**args, **overrides})


@pytest.mark.parametrize("overrides,message", [
    ({"pp_size": 2}, r"--pp-size 2 is not supported \(pipeline parallelism"),
    ({"enable_dp_attention": True}, "--enable-dp-attention is not supported"),
    ({"attn_cp_size": 2}, "--attn-cp-size 2 is not supported"),
    ({"dcp_size": 2}, "--dcp-size 2 is not supported"),
])
def test_unsupported_layouts_are_refused(overrides, message):
    with pytest.raises(ValueError, match=message):
        check_layout(_server_args(**overrides))


def test_admission_with_tensor_parallelism_is_refused(monkeypatch):
    monkeypatch.setenv("NOSA_OFFLOAD", "1")
    monkeypatch.setenv("NOSA_HOST_KV_TOKENS", "3000")
    monkeypatch.setenv("NOSA_DEVICE_KV_TOKENS", "256")
    check_layout(_server_args())  # offloading itself is fine with TP
    monkeypatch.setenv("NOSA_ADMISSION", "1")
    check_layout(_server_args(tp_size=1))  # and admission with one rank (or DP replicas)
    with pytest.raises(ValueError, match=r"\$NOSA_ADMISSION=1 decides from this rank's own timings"):
        check_layout(_server_args())


def test_rank_path(monkeypatch):
    import nosa.serve.parallel as parallel

    cases = {(0, 1, None): "s.json", (1, 2, None): "s.tp1.json", (0, 1, 1): "s.dp1.json", (1, 2, 0): "s.dp0.tp1.json"}
    for ranks, want in cases.items():
        monkeypatch.setattr(parallel, "process_ranks", lambda ranks=ranks: ranks)
        assert rank_path("/x/s.json") == "/x/" + want
    assert rank_path(None) is None


def test_cpu_groups_are_built_without_pynccl():
    seen = {}

    def init_model_parallel_group(group_ranks, local_rank, backend, use_pynccl=None, group_name=None):
        seen.update(use_pynccl=use_pynccl, group_name=group_name, backend=backend)

    group_without_pynccl(init_model_parallel_group, [[0, 1]], 0, "gloo", group_name="tp")
    assert seen == {"use_pynccl": False, "group_name": "tp", "backend": "gloo"}
    group_without_pynccl(init_model_parallel_group, [[0, 1]], 0, "gloo", True)  # even when asked for
    assert seen["use_pynccl"] is False
