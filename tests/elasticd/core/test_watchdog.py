"""The watchdog's verdicts (elasticd/core/watchdog.py), driven by hand: which agents are stuck, which are only
slow, and how the bound follows the job's steps; the beat file an agent writes and its supervisor reads."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from elasticd.core.watchdog import (
    FACTOR,
    FIRST_BOUND_S,
    FLOOR_S,
    WARM_STEPS,
    Beat,
    BeatWriter,
    StuckAfter,
    Watchdog,
    beat_path,
    read_beat,
)


def computing(since: float, step: int = 10, step_at: float = 0.0) -> Beat:
    return Beat(False, since, step, step_at)


def waiting(since: float, step: int = 10, step_at: float = 0.0) -> Beat:
    return Beat(True, since, step, step_at)


def test_stuck_after_takes_seconds_auto_and_off_and_refuses_the_rest() -> None:
    assert StuckAfter.parse("90") == StuckAfter(90.0) == StuckAfter.parse(" 90s ")
    assert StuckAfter.parse("auto") == StuckAfter()
    assert StuckAfter.parse("off").off and StuckAfter.parse("0").off
    assert [str(StuckAfter.parse(t)) for t in ("2.5", "auto", "off")] == ["2.5s", "auto", "off"]
    for bad in ("-1", "soon", "inf", "nan", ""):
        with pytest.raises(ValueError, match="--stuck-after"):
            StuckAfter.parse(bad)


def test_a_process_stopped_longer_than_the_bound_is_fenced_and_one_continued_in_time_is_not() -> None:
    dog = Watchdog(StuckAfter(5.0))
    for now in (0.0, 3.0):
        dog.observe("a", now, True, computing(0.0))
        dog.observe("b", now, False, waiting(0.5))
    assert dog.verdict(3.0) == []
    dog.observe("a", 4.0, False, computing(0.0))   # SIGCONT: b's collective returns
    dog.observe("b", 4.0, False, computing(4.0))
    dog.observe("a", 9.0, True, computing(5.0))    # stopped again: counted afresh
    dog.observe("b", 9.0, False, waiting(8.5))
    assert dog.verdict(9.0) == []
    dog.observe("a", 14.5, True, computing(5.0))
    dog.observe("b", 14.5, False, waiting(8.5))
    [fence] = dog.verdict(14.5)
    assert fence.key == "a" and fence.reason == "stopped for 6s"


def test_the_agent_the_others_wait_for_is_fenced_not_the_waiting_ones() -> None:
    dog = Watchdog(StuckAfter(5.0))
    dog.observe(0, 10.0, False, waiting(2.0))
    dog.observe(1, 10.0, False, computing(1.0))   # a wedged kernel, a deadlock in the user's code
    dog.observe(2, 10.0, False, waiting(1.5))
    [fence] = dog.verdict(10.0)
    assert fence.key == 1 and fence.reason == "2 other agent(s) waited 8s in a collective it did not join"
    assert dog.verdict(6.0) == []   # not for long enough yet
    dog.observe(1, 10.5, True, computing(1.0))   # seen stopped only now: the wait says how long it held the others
    assert dog.verdict(10.5)[0].reason == "stopped, and 2 other agent(s) waited 9s in a collective for it"


def test_a_process_stopped_inside_the_collective_the_others_wait_in_is_the_one_fenced() -> None:
    """Its beat says it is inside the collective too, so without its state every agent would look hung."""
    dog = Watchdog(StuckAfter(5.0))
    dog.observe(0, 9.0, False, waiting(2.0))
    dog.observe(1, 9.0, True, waiting(1.0))   # SIGSTOPped inside the flush; seen stopped only just now
    [fence] = dog.verdict(9.0)
    assert fence.key == 1 and fence.reason == "stopped, and 1 other agent(s) waited 7s in a collective for it"


def test_every_agent_inside_a_collective_for_too_long_is_fenced() -> None:
    dog = Watchdog(StuckAfter(5.0))
    for k in range(3):
        dog.observe(k, 20.0, False, waiting(10.0 + k))
    assert sorted(f.key for f in dog.verdict(20.0)) == [0, 1, 2]
    # One entered lately: the others wait on a collective that is still being joined, and no agent stays
    # out of one for the bound, so no one is fenced yet.
    dog.observe(2, 20.0, False, waiting(16.0))
    assert dog.verdict(20.0) == []


def test_a_slow_agent_no_one_waits_for_is_never_fenced() -> None:
    dog = Watchdog(StuckAfter(5.0))
    dog.observe(0, 1000.0, False, computing(0.0))   # every agent evaluating for a long time
    dog.observe(1, 1000.0, False, computing(0.0))
    assert dog.verdict(1000.0) == []
    off = Watchdog(StuckAfter(off=True))
    off.observe(0, 1000.0, True, computing(0.0))
    off.observe(1, 1000.0, False, waiting(0.0))
    assert off.verdict(1000.0) == []


def test_the_automatic_bound_waits_out_the_first_steps_then_follows_the_slowest_step() -> None:
    dog = Watchdog(StuckAfter())
    dog.observe(0, 0.0, False, None)
    assert dog.bound() == FIRST_BOUND_S and dog.describe() == f"auto: {FIRST_BOUND_S:.0f}s now"
    for step in range(WARM_STEPS + 1):     # 1 s steps: the floor holds
        dog.observe(0, step + 1.0, False, computing(step + 1.0, step=step, step_at=step + 1.0))
    assert dog.bound() == FLOOR_S
    # An evaluation made one interval 40 s: the bound stretches to FACTOR times it.
    dog.observe(0, 60.0, False, computing(60.0, step=WARM_STEPS + 1, step_at=WARM_STEPS + 41.0))
    assert dog.bound() == FACTOR * 40.0
    # An agent still in its first steps keeps the whole job at the first bound.
    dog.observe(1, 61.0, False, computing(61.0, step=0, step_at=61.0))
    assert dog.bound() == FIRST_BOUND_S


def test_agents_no_longer_retained_are_forgotten() -> None:
    dog = Watchdog(StuckAfter(1.0))
    dog.observe(111, 0.0, True, None)
    dog.observe(222, 0.0, False, waiting(0.0))
    dog.retain([222])                            # 111 exited: its stop says nothing now
    dog.observe(222, 5.0, False, waiting(0.0))
    assert [f.key for f in dog.verdict(5.0)] == [222]


def test_the_beat_file_shows_collectives_entered_and_left_and_the_last_step(tmp_path: Path) -> None:
    path = beat_path(str(tmp_path / "agent0.json"))
    assert read_beat(path) is None
    w = BeatWriter(path)
    try:
        first = read_beat(path)
        assert first is not None and not first.in_collective and first.step == -1
        before = time.monotonic()
        w.entered()
        w.entered()    # nested: one wait
        w.left()
        inside = read_beat(path)
        assert inside is not None and inside.in_collective and inside.since >= before
        w.left()
        w.stepped(7)
        out = read_beat(path)
        assert out is not None and not out.in_collective and out.step == 7 and out.step_at >= inside.since
    finally:
        w.close()
