"""The learned cost model and the re-layout gate: pure logic, no processes."""

from __future__ import annotations

import math
import random

import msgpack
import pytest

from elasticd.placement import CostModel, Placement, RelayoutGate, device_key


def test_a_spike_is_ignored_and_a_straggler_shows_within_three_reports_both_ways():
    m = CostModel()
    for t in range(5):
        m.observe_compute("n0/0", 1.0, t, "j")
    m.observe_compute("n0/0", 25.0, 5, "j")   # one page-cache miss, a neighbour's burst
    assert m.worker_step_seconds("n0/0") == 1.0
    for t in range(6, 8):
        m.observe_compute("n0/0", 2.0, t, "j")
    m.observe_compute("n0/0", 2.0, 8, "j")    # third report at the new level: the median has moved
    assert m.worker_step_seconds("n0/0") == 2.0
    for t in range(9, 12):
        m.observe_compute("n0/0", 1.0, t, "j")
    assert m.worker_step_seconds("n0/0") == 1.0


def test_speeds_are_learned_as_ratios_within_a_job_and_carry_to_another_job():
    m = CostModel()
    for t in range(3):
        m.observe_compute("n0/0", 0.2, t, "big")
        m.observe_compute("n0/1", 0.4, t, "big")
    assert m.speed("n0/0") == pytest.approx(1.0) and m.speed("n0/1") == pytest.approx(0.5)
    # a job 100x lighter, measured on the fast device only: its own seconds, the slow device's ratio
    m.observe_compute("n0/0", 0.002, 10, "small")
    assert m.estimate("small", "n0/0") == pytest.approx(0.002)
    assert m.estimate("small", "n0/1") == pytest.approx(0.004)
    assert m.speed("n0/1") == pytest.approx(0.5)          # one device teaches no ratio
    # a job nothing was measured for: reference units, ratios from the fitted speeds
    assert m.estimate("new", "n0/1") / m.estimate("new", "n0/0") == pytest.approx(2.0)
    assert m.worker_step_seconds("n0/1") == pytest.approx(0.4)   # the job that last ran there
    assert m.worker_step_seconds("n0/1", "small") is None


def test_priors_rank_devices_until_measured_then_measurements_win():
    m = CostModel({"a/0": 1.0, "a/1": 0.5})
    assert m.speed("a/1") == 0.5 and m.speed("zz/9") == 1.0
    assert m.estimate("j", "a/1") == pytest.approx(2.0)
    for t in range(3):   # the declared-slow device is in fact as fast
        m.observe_compute("a/0", 0.1, t, "j")
        m.observe_compute("a/1", 0.1, t, "j")
    # the least slowed device of the job is taken at its declared speed: here a/1 at 0.5, so a/0 too
    assert m.speed("a/0") == pytest.approx(0.5) and m.speed("a/1") == pytest.approx(0.5)
    assert m.estimate("j", "a/1") == pytest.approx(0.1)


def test_comm_reads_the_lowest_reports_and_extrapolates_over_m():
    m = CostModel()
    assert m.comm_seconds("j", 4) == 0.0 and m.comm_seconds("j", 1) == 0.0
    for t in range(4):   # the early agent waited 0.5 s for the late one; the collective itself is 0.1 s
        m.observe_comm("j", 2, 0.6, t)
        m.observe_comm("j", 2, 0.1, t)
    assert m.comm_seconds("j", 2) == pytest.approx(0.1)
    assert m.comm_seconds("j", 4) == pytest.approx(0.1 * 1.5)        # ring shape 2(M-1)/M from one point
    for t in range(4):
        for _ in range(4):
            m.observe_comm("j", 4, 0.2, t)
    # two points: a + b*g fitted through (1.0, 0.1) and (1.5, 0.2) -> b = 0.2, a = -0.1 -> clamped a = 0
    assert m.comm_seconds("j", 4) == pytest.approx(0.2)
    want = max(0.0, sum(g * v for g, v in [(1.0, 0.1), (1.5, 0.2)]) / (1.0 + 2.25) * (2 * 7 / 8))
    assert m.comm_seconds("j", 8) == pytest.approx(want)
    m.observe_comm("j", 1, 5.0, 9)   # one agent: no collective, nothing learned
    assert m.comm_seconds("j", 1) == 0.0
    m.forget_job("j")
    assert m.comm_seconds("j", 2) == 0.0


def test_the_issue_arithmetic_n8_on_a_fast_and_a_half_speed_device():
    m = CostModel({"n0/0": 1.0, "n1/0": 0.5})
    assert m.predict_step("j", [("n0/0", 4), ("n1/0", 4)]) == pytest.approx(8.0)
    assert m.predict_step("j", [("n0/0", 6), ("n1/0", 2)]) == pytest.approx(6.0)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, "x"])
def test_bad_input_is_refused_and_loses_nothing(bad):
    m = CostModel()
    m.observe_compute("d", 1.0, 0, "j")
    before = m.to_dict()
    with pytest.raises(ValueError):
        m.observe_compute("d", bad, 1, "j")
    with pytest.raises(ValueError):
        m.set_prior("d", bad)
    if bad != 0.0:
        with pytest.raises(ValueError):
            m.observe_comm("j", 2, bad, 1)
    with pytest.raises(ValueError):
        m.observe_compute("d", 1.0, math.nan, "j")
    with pytest.raises(ValueError):
        m.observe_comm("j", 0, 1.0, 1)
    assert m.to_dict() == before
    with pytest.raises(ValueError):
        m.predict_step("j", [])
    with pytest.raises(ValueError):
        m.predict_step("j", [("d", 0)])


def test_state_round_trips_through_msgpack_and_a_foreign_dict_is_refused():
    m = CostModel({device_key("n0", "cpu:0"): 0.5})
    for t in range(3):
        m.observe_compute("n0/cpu:0", 0.3, t, "j")
        m.observe_compute("n0/cpu:1", 0.1, t, "j")
        m.observe_comm("j", 2, 0.05, t)
    back = CostModel.from_dict(msgpack.unpackb(msgpack.packb(m.to_dict()), strict_map_key=False))
    assert back.to_dict() == m.to_dict()
    assert back.predict_step("j", [("n0/cpu:0", 1), ("n0/cpu:1", 3)]) == m.predict_step(
        "j", [("n0/cpu:0", 1), ("n0/cpu:1", 3)])
    for bad in [{}, {"format": 99}, {**m.to_dict(), "speeds": {"d": -1}}, {**m.to_dict(), "compute": 3}]:
        with pytest.raises(ValueError):
            CostModel.from_dict(bad)


def _p(s: float) -> Placement:
    return Placement((("d", 1),), s, True)


def test_gate_needs_a_clear_gain_on_consecutive_checks_and_a_cooldown():
    g = RelayoutGate(min_gain=0.10, patience=3, cooldown_s=30.0)
    assert g.check("j", 8.0, _p(6.0), 0) == (False, pytest.approx(0.25))
    assert g.check("j", 8.0, _p(6.0), 1)[0] is False
    assert g.check("j", 8.0, _p(7.5), 2)[0] is False     # 6% breaks the streak
    assert [g.check("j", 8.0, _p(6.0), t)[0] for t in (3, 4, 5)] == [False, False, True]
    g.done("j", 5)
    assert [g.check("j", 8.0, _p(6.0), t)[0] for t in (6, 7, 8, 34)] == [False, False, False, False]
    assert g.check("j", 8.0, _p(6.0), 35)[0] is True     # cooled down, streak long since met
    assert g.check("other", 8.0, _p(6.0), 35)[0] is False  # per job
    assert g.check("j", 0.0, _p(6.0), 36) == (False, 0.0)
    back = RelayoutGate.from_dict(msgpack.unpackb(msgpack.packb(g.to_dict())))
    assert back.to_dict() == g.to_dict()
    with pytest.raises(ValueError):
        RelayoutGate(patience=0)
    with pytest.raises(ValueError):
        RelayoutGate.from_dict({"min_gain": 0.1})


def test_noise_between_equal_devices_is_not_learned_a_real_slowdown_is():
    rng = random.Random(4)
    m = CostModel()
    devices = [f"n0/{i}" for i in range(6)]
    for t in range(5):
        for d in devices:   # +-8% noise on equal devices
            m.observe_compute(d, 0.5 * (1 + 0.16 * (rng.random() - 0.5)), t, "j")
    assert {m.speed(d) for d in devices} == {1.0}
    assert len(set(m.estimates("j", devices).values())) == 1
    assert m.work("j") == pytest.approx(0.5, rel=0.05)
    for t in range(5, 10):   # n0/5 now at 3/4 speed: shows on the third report, settles by the fifth
        for d in devices:
            slow = 0.5 / 0.75 if d == "n0/5" else 0.5
            m.observe_compute(d, slow * (1 + 0.16 * (rng.random() - 0.5)), t, "j")
        if t == 7:
            assert m.speed("n0/5") < 0.9
    assert m.speed("n0/5") == pytest.approx(0.75, rel=0.08) and m.speed("n0/0") == 1.0
    for t in range(10, 13):  # and back to its declared speed once the slowdown is gone
        for d in devices:
            m.observe_compute(d, 0.5, t, "j")
    assert m.speed("n0/5") == 1.0


def test_a_learned_slowdown_expires_after_the_device_has_been_silent_for_stale_s():
    m = CostModel({"n/2": 0.8}, stale_s=600)
    for t in range(3):   # n/2 and n/3 measured 2x slower than n/0 under one job
        for d, c in (("n/0", 0.1), ("n/1", 0.1), ("n/2", 0.2), ("n/3", 0.2)):
            m.observe_compute(d, c, t, "j")
    assert m.speed("n/2") == pytest.approx(0.5) and m.speed("n/3") == pytest.approx(0.5)
    m.forget_job("j")
    for t in range(10, 610, 100):   # n/3 keeps running another job (2x slower than its partner), n/2 is idle
        m.observe_compute("n/3", 0.4, t, "k")
        m.observe_compute("n/0", 0.2, t, "k")
    assert m.expire(601) == {}   # 599 s of silence: kept
    assert m.expire(602) == {"n/2": pytest.approx(0.5)}
    assert m.speed("n/2") == 0.8                       # back to its declared speed, not to 1.0
    assert m.speed("n/3") == pytest.approx(0.5)        # still reporting: still learned
    back = CostModel.from_dict(m.to_dict())
    assert back.stale_s == 600 and back.to_dict() == m.to_dict()
    older = {k: v for k, v in m.to_dict().items() if k != "stale_s"}   # saved before stale_s existed
    assert CostModel.from_dict(older).stale_s == 600
    with pytest.raises(ValueError):
        CostModel(stale_s=0)

