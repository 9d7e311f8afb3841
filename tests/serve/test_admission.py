"""Unit tests of the I/O-adaptive admission policy (nosa.serve.offload.admission) with a simulated link:
the decisions change the way the documented policy says."""

from __future__ import annotations

import pytest
import torch

from nosa.serve.offload.admission import Admission, AdmissionPolicy, probe_bandwidth

ITEM = 1000  # bytes per (block, KV head) item
TOPK = 8


def _admission(bw, max_extra=4, headroom=0.5):
    return Admission(AdmissionPolicy(headroom=headroom, alpha=0.5, max_extra=max_extra), ITEM, TOPK,
                     bound_items=10, bandwidth=bw)


def _simulate(adm, link_bw, groups: dict[int, tuple[int, int]], compute=0.01, steps=5):
    """groups: g -> (context blocks, items recalled per step); each step's recall is 'copied' over a
    link of ``link_bw`` bytes/s (observe_transfer) and reported with the step."""
    for _ in range(steps):
        recalled = {g: items * ITEM for g, (_, items) in groups.items()}
        total = sum(recalled.values())
        if total:
            adm.observe_transfer(total, total / link_bw)
        adm.observe_step(compute, recalled, {g: n for g, (n, _) in groups.items()})


def test_new_requests_wait_when_their_recall_cannot_be_hidden_and_are_admitted_when_it_can():
    # hideable = 0.5 * bw * 10 ms; three offloaded requests recall 20 items (20 KB) each per step
    running = {0: (100, 20), 1: (100, 20), 2: (100, 20)}
    slow = _admission(bw=1e6)
    _simulate(slow, 1e6, running)  # hideable 5 KB/step < demand 60 KB: nobody else may start
    assert slow.hideable() == pytest.approx(5000, rel=1e-6)
    assert slow.allowed_new(running=3) == 0
    assert slow.decisions["wait"] == 1
    fast = _admission(bw=1e8)
    _simulate(fast, 1e8, running)  # hideable 500 KB/step: (500 - 60) / 20 = 22 more
    assert fast.allowed_new(running=3) == 22
    assert fast.decisions["admit"] == 1
    # the bandwidth estimate follows the link: the slow controller admits once the link speeds up
    _simulate(slow, 1e9, running, steps=30)
    assert slow.bw == pytest.approx(1e9, rel=1e-3)
    assert slow.allowed_new(running=3) > 0


def test_nothing_running_always_admits_and_no_measurement_admits():
    adm = _admission(bw=1.0)
    assert adm.allowed_new(running=0) > 0
    assert _admission(bw=None).allowed_new(running=2) > 0  # no estimate yet: nothing to hold back on


def test_before_any_miss_measurement_a_new_request_is_estimated_at_the_locality_bound():
    adm = _admission(bw=1e6)
    _simulate(adm, 1e6, {0: (4, 0)})  # one resident request, recalls nothing
    # hideable 5000 B/step, demand 0, estimate for a new one = bound 10 items = 10 KB -> wait
    assert adm.allowed_new(running=1) == 0
    adm.policy = AdmissionPolicy(headroom=1.0, alpha=0.5, max_extra=4)
    _simulate(adm, 1e6, {0: (4, 0)}, compute=0.02)  # hideable now 1 * 1e6 * ~0.02 s
    assert adm.allowed_new(running=1) == 1


def test_extra_slots_go_first_to_requests_they_make_fully_resident_then_to_the_most_missing():
    adm = _admission(bw=1e6, max_extra=4)
    groups = {0: (10, 5), 1: (40, 30), 2: (40, 2), 3: (TOPK, 0)}
    _simulate(adm, 1e6, groups)
    grants = adm.grants(spare=7)
    # group 0 needs 2 extra slots to hold all its 10 blocks: resident; group 1 misses most: the
    # remaining 5 spare -> its cap of 4; group 2 gets the last one; group 3 already fits
    assert grants == {0: 2, 1: 4, 2: 1, 3: 0}
    assert adm.resident(0) and adm.resident(3) and not adm.resident(1)
    assert adm.decisions["resident"] == 2 and adm.decisions["offloaded"] == 2
    assert adm.decisions["grant"] == 3
    # a new request takes columns back: fewer spare -> the grants shrink, counted as revocations
    grants = adm.grants(spare=2)
    assert grants == {0: 2, 1: 0, 2: 0, 3: 0}
    assert adm.decisions["revoke"] == 2
    # a resident request recalls nothing, so it does not count against the hideable budget
    assert adm.demand() == pytest.approx(sum(m for g, m in adm.misses.items() if g in (1, 2)))


def test_a_request_that_left_is_forgotten_and_admission_reopens():
    adm = _admission(bw=1e6)
    _simulate(adm, 1e6, {0: (100, 3), 1: (100, 3)})  # demand 6 KB > hideable 5 KB
    assert adm.allowed_new(running=2) == 0
    adm.forget(1)
    # demand 3 KB, slack 2 KB < one more request's 3 KB: still wait; a faster step opens it
    assert adm.allowed_new(running=1) == 0
    _simulate(adm, 1e6, {0: (100, 3)}, compute=0.05, steps=20)
    assert adm.allowed_new(running=1) >= 1


def test_bad_policy_values_are_rejected_with_the_field_named():
    with pytest.raises(ValueError, match="headroom"):
        AdmissionPolicy(headroom=0)
    with pytest.raises(ValueError, match="alpha"):
        AdmissionPolicy(alpha=2)
    with pytest.raises(ValueError, match="max_extra"):
        AdmissionPolicy(max_extra=-1)


def test_probe_measures_a_batched_recall():
    src = [torch.randn(300, 16, 8), torch.randn(300, 16)]
    dst = [torch.zeros(64, 16, 8), torch.zeros(64, 16)]
    bw, nbytes, seconds = probe_bandwidth(dst, src, items=64)
    assert nbytes == 64 * (16 * 8 * 4 + 16 * 4) and seconds > 0 and bw == pytest.approx(nbytes / seconds)
    assert torch.equal(dst[0], src[0][:64])


def test_block_cache_lends_idle_columns_as_extra_slots_and_takes_them_back():
    """Admission layout: 3 groups own 2 slots each (home), up to 2 extra. Group 0 borrows idle
    columns: with 4 slots its alternating selections become hits; group 1 starting takes its
    columns back and group 0's borrowed blocks are dropped. Resolved rows always hold the right data."""
    pytest.importorskip("sglang")
    from nosa.serve.offload.block_cache import DeviceBlockCache

    B, HKV, D = 4, 2, 3
    cache = DeviceBlockCache(1, 3, HKV, 4, B, D, D, torch.float32, "cpu", home_slots=2)
    g = torch.Generator().manual_seed(0)
    host = (torch.randn(20 * HKV, B, D, generator=g), torch.randn(20 * HKV, B, D, generator=g),
            torch.randn(20 * HKV, B, generator=g))
    picks = [torch.tensor([[[0, 1]] * HKV]), torch.tensor([[[2, 3]] * HKV])]

    def step(i, rows=(1,)):
        wanted = picks[i % 2].expand(len(rows), HKV, 2)
        found = cache.resolve(0, cache.groups_of(list(rows)), wanted, [40] * len(rows), wanted + 5, host)
        want_k = host[0][((wanted + 5) * HKV + torch.arange(HKV)[None, :, None]).flatten()]
        got_k = found.k.view(-1, B, D)[found.slots.flatten()]
        assert torch.equal(got_k, want_k)

    cache.activate(1)
    assert cache.free_columns() == 4  # groups 1 and 2 idle, 2 columns each
    assert cache.set_extra({0: 2}) == {0: 2}
    for i in range(4):
        step(i)
    assert cache.stats["misses"][0] == 4 * HKV and cache.stats["hits"][0] == 4 * HKV  # 0,1 and 2,3 stay
    cache.activate(2)  # group 1 starts: the two columns group 0 borrowed from it come back
    assert cache.lent == {} and int((cache.col_of[0, 2:] >= 0).sum()) == 0
    assert cache.free_columns() == 2  # group 2 (row 3) is idle
    step(4, rows=(1, 2))
    cache.release(2)
    assert cache.set_extra({0: 1}) == {0: 1}
