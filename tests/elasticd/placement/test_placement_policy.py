"""The placement policy as pure functions: no sockets, no clock."""

from __future__ import annotations

import pytest

from elasticd.placement.policy import JobRequest, NodeView, best_device_count, place, spread


def nodes(*counts: int) -> list[NodeView]:
    return [NodeView(f"n{i}", tuple(f"cpu:{d}" for d in range(c)), 0, c) for i, c in enumerate(counts)]


@pytest.mark.parametrize("n,lo,hi,want", [
    (8, 1, 8, 8), (8, 1, 7, 4), (8, 1, 3, 3), (8, 5, 7, 5), (6, 1, 5, 3), (7, 1, 5, 4), (2, 1, 1, 1), (1, 1, 1, 1),
])
def test_best_device_count_prefers_fewest_workers_per_device_then_fewest_devices(n, lo, hi, want):
    assert best_device_count(n, lo, hi) == want


def test_spread_takes_from_the_node_with_most_free_and_groups_ranks_by_node():
    got = spread(4, nodes(2, 3))
    assert sorted(got) == sorted([("n1", "cpu:0"), ("n1", "cpu:1"), ("n0", "cpu:0"), ("n0", "cpu:1")])
    # contiguous per node, rank 0 on the node picked first (the one with most free devices)
    assert [n for n, _ in got] == ["n1", "n1", "n0", "n0"]
    with pytest.raises(ValueError):
        spread(6, nodes(2, 3))


def test_higher_priority_gets_its_maximum_first_and_lower_priority_its_minimum():
    jobs = [JobRequest("low", 2, 1, 2, priority=0, seq=1), JobRequest("high", 2, 1, 2, priority=5, seq=2)]
    got = place(jobs, nodes(3))
    assert len(got["high"]) == 2 and len(got["low"]) == 1
    assert not set(got["high"]) & set(got["low"])


def test_two_jobs_share_two_devices():
    jobs = [JobRequest("a", 4, 1, 4, priority=0, seq=1), JobRequest("b", 4, 1, 4, priority=1, seq=2)]
    got = place(jobs, nodes(2))
    assert {k: len(v) for k, v in got.items()} == {"a": 1, "b": 1}


def test_gang_a_job_that_does_not_fit_blocks_lower_priority_ones():
    jobs = [JobRequest("wide", 4, 4, 4, priority=9, seq=1), JobRequest("narrow", 1, 1, 1, priority=0, seq=2)]
    busy_one = [NodeView("n0", ("cpu:1", "cpu:2", "cpu:3"), load=1, total=4)]
    assert place(jobs, busy_one) == {}


def test_a_job_wider_than_the_island_is_skipped_not_blocking():
    jobs = [JobRequest("huge", 16, 16, 16, priority=9, seq=1), JobRequest("small", 2, 1, 2, seq=2)]
    got = place(jobs, nodes(2))
    assert list(got) == ["small"] and len(got["small"]) == 2


def test_growth_prefers_m_dividing_n():
    got = place([JobRequest("j", 8, 1, 8, seq=1)], nodes(7))
    assert len(got["j"]) == 4


def test_fixed_device_count_from_scale_is_used_exactly():
    got = place([JobRequest("j", 8, 1, 8, seq=1, fixed=2)], nodes(8))
    assert len(got["j"]) == 2


def test_one_job_spans_two_single_device_nodes():
    got = place([JobRequest("j", 2, 2, 2, seq=1)], nodes(1, 1))
    assert sorted(n for n, _ in got["j"]) == ["n0", "n1"]


def test_same_priority_goes_by_submission_order():
    jobs = [JobRequest("second", 2, 2, 2, seq=2), JobRequest("first", 2, 2, 2, seq=1)]
    assert list(place(jobs, nodes(2))) == ["first"]


def test_rebalance_preempts_lowest_priority_newest_first_just_enough_and_never_for_nothing():
    from elasticd.placement.policy import RunningJob, rebalance

    head = JobRequest("q", workers=2, min_devices=2, max_devices=2, priority=5, seq=9)
    old = RunningJob("old", workers=4, devices=4, min_devices=1, max_devices=4, priority=0, seq=1)
    new = RunningJob("new", workers=8, devices=4, min_devices=2, max_devices=8, priority=0, seq=2)
    full = [NodeView("n0", (), 8, 8)]
    got = rebalance([head], [old, new], full)
    assert [(r.job_id, r.devices) for r in got] == [("new", 2)]
    assert got[0].why == "policy: preempted by job q"
    # N=4 needing to give 1 device goes to 2 (3 steps no faster than 2); higher priority is never shrunk
    need3 = JobRequest("q", workers=3, min_devices=3, max_devices=3, priority=5, seq=9)
    vip = RunningJob("vip", workers=4, devices=4, min_devices=1, max_devices=4, priority=9, seq=0)
    assert [(r.job_id, r.devices) for r in rebalance([need3], [vip, old], [NodeView("n0", (), 8, 8)])] == [("old", 1)]
    # not enough room even at everyone's minimum: nobody shrinks
    wide = JobRequest("q", workers=8, min_devices=8, max_devices=8, priority=5, seq=9)
    assert rebalance([wide], [old], [NodeView("n0", (), 4, 8)]) == []
    # equal priority never preempts
    assert rebalance([JobRequest("q", 2, 2, 2, priority=0, seq=9)], [old], [NodeView("n0", (), 4, 4)]) == []


def test_a_job_that_may_give_every_device_back_is_preempted_to_none():
    from elasticd.placement.policy import RunningJob, rebalance

    # a portion of a job spanning islands: its front moves the whole job off what it gives back
    portion = RunningJob("p", workers=4, devices=1, min_devices=0, max_devices=1, priority=0, seq=1)
    head = JobRequest("q", workers=1, min_devices=1, max_devices=1, priority=5, seq=9)
    assert [(r.job_id, r.devices) for r in rebalance([head], [portion], [NodeView("n0", (), 1, 1)])] == [("p", 0)]
    two = RunningJob("p", workers=4, devices=2, min_devices=0, max_devices=2, priority=0, seq=1)
    assert [(r.job_id, r.devices) for r in rebalance([head], [two], [NodeView("n0", (), 2, 2)])] == [("p", 1)]


def test_rebalance_grows_into_free_devices_only_when_nothing_can_start_and_it_helps():
    from elasticd.placement.policy import RunningJob, rebalance

    job = RunningJob("a", workers=4, devices=2, min_devices=1, max_devices=4)
    two_free = [NodeView("n0", ("cpu:2", "cpu:3"), 2, 4)]
    assert [(r.job_id, r.devices, r.why) for r in rebalance([], [job], two_free)] == [
        ("a", 4, "policy: grow into freed devices")]
    one_free = [NodeView("n0", ("cpu:3",), 3, 4)]
    assert rebalance([], [job], one_free) == []   # 3 devices step no faster than 2 for N=4
    waiting = JobRequest("w", workers=2, min_devices=2, max_devices=2, seq=5)
    assert rebalance([waiting], [job], two_free) == []   # it starts on them instead
    capped = RunningJob("c", workers=4, devices=2, min_devices=1, max_devices=2)
    assert rebalance([], [capped], two_free) == []
