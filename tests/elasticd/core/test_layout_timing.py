"""The agents' step timing (elasticd/core/timing.py): the pure accounting, its merging when a channel
throttles reports, and a really slowed agent (its process duty-cycled with SIGSTOP/SIGCONT) reporting more
compute per hosted worker while the fast agent's collective time absorbs the waiting."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest
import zmq
from util import JOBS, wait_until

from elasticd import protocol as p
from elasticd.agent.control.zmq_channel import ZmqControl
from elasticd.agent.proc_name import agents_under
from elasticd.core.timing import StepTiming, clean_timing, merge_timing


def test_compute_is_the_step_less_its_collectives_and_the_first_boundary_only_starts_the_clock():
    t = StepTiming(hosted=3)
    t.add_flush(5.0)        # before the first boundary: startup, not a step
    t.boundary(10.0)
    assert t.take() == {}
    t.add_flush(0.25)
    t.add_flush(0.25)
    t.boundary(12.0)        # a 2 s step: 0.5 s in collectives
    t.add_flush(1.0)
    t.boundary(16.0)        # a 4 s step: 1 s in collectives
    assert t.take() == {"hosted": 3, "compute_s": (1.5 + 3.0) / 2, "flush_s": 0.75, "steps": 2}
    assert t.take() == {}
    t.boundary(17.0)
    assert t.take() == {"hosted": 3, "compute_s": 1.0, "flush_s": 0.0, "steps": 1}


def test_reports_merge_step_weighted_and_bad_ones_are_refused():
    a = {"hosted": 2, "compute_s": 1.0, "flush_s": 0.5, "steps": 1}
    b = {"hosted": 2, "compute_s": 2.0, "flush_s": 0.0, "steps": 3}
    assert merge_timing(a, b) == {"hosted": 2, "compute_s": 1.75, "flush_s": 0.125, "steps": 4}
    assert merge_timing(None, b) == b and merge_timing(a, {}) == a
    assert clean_timing({**a, "compute_s": 1}) == a
    for bad in ({}, {**a, "steps": 0}, {**a, "hosted": "2"}, {**a, "flush_s": float("nan")}, {**a, "compute_s": -1}):
        with pytest.raises(ValueError):
            clean_timing(bad)


@contextlib.contextmanager
def throttled_channel(tmp_path: Path) -> Iterator[tuple[ZmqControl, Callable[[int], list[p.Message]]]]:
    """An agent's control channel that reports a step at most once an hour, and a reader of what reached
    the daemon's end."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    endpoint = f"ipc://{tmp_path}/agent.sock"
    router.bind(endpoint)
    router.rcvtimeo = 10_000
    control = ZmqControl(endpoint, "j1", 0, step_every_s=3600.0)
    try:
        yield control, lambda n: [p.decode(router.recv_multipart()[-1]) for _ in range(n)]
    finally:
        control.close()
        router.close(linger=0)
        ctx.term()


def test_a_throttled_step_report_keeps_its_timing_in_the_next_one(tmp_path: Path):
    with throttled_channel(tmp_path) as (control, received):
        one = {"hosted": 2, "compute_s": 1.0, "flush_s": 0.0, "steps": 1}
        control.step(0, {}, one)                                     # sent: the first report goes at once
        control.step(1, {}, one)                                     # throttled: pending
        control.step(2, {}, {**one, "compute_s": 4.0, "steps": 2})   # replaces it, its timing included
        control.done(stopped=False)                                  # flushes the pending report
        got = received(3)
        assert [m.step for m in got[:2]] == [0, 2]
        assert got[1].timing == {"hosted": 2, "compute_s": 3.0, "flush_s": 0.0, "steps": 3}


def test_a_held_step_is_reported_at_once_inside_the_throttle(tmp_path: Path):
    """The agents wait after a --scale-at step until the resize comes, and it comes once the report is read."""
    with throttled_channel(tmp_path) as (control, received):
        one = {"hosted": 1, "compute_s": 1.0, "flush_s": 0.0, "steps": 1}
        control.step(0, {}, one)              # sent: the first report goes at once
        control.step(1, {}, one)              # throttled: pending
        control.step(2, {}, one, held=True)   # sent now, step 1's timing in it
        got = received(2)
        assert [m.step for m in got] == [0, 2]
        assert got[1].timing["steps"] == 2


def _duty_cycle(proc: psutil.Process, stop_s: float, run_s: float, done: threading.Event) -> None:
    """Make `proc` run only run_s of every stop_s + run_s seconds, until it exits or `done` is set."""
    try:
        while not done.is_set():
            proc.suspend()
            time.sleep(stop_s)   # the load pattern itself, not a wait for anything
            proc.resume()
            time.sleep(run_s)
    except psutil.NoSuchProcess:
        pass
    finally:
        try:
            proc.resume()
        except psutil.NoSuchProcess:
            pass


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_slowed_agent_reports_more_compute_per_worker_and_the_fast_one_waits_in_its_flushes(tmp_path: Path):
    summary = tmp_path / "summary.json"
    env = {**os.environ, "ELASTICD_TEST_WORKERS": "4", "ELASTICD_TEST_STEPS": "30"}
    # Uniform 2/2: both agents do the same work, so the imposed slowdown is all that tells them apart.
    launcher = subprocess.Popen([sys.executable, "-m", "elasticd", "run", str(JOBS / "timed_job.py"), "--devices", "2",
                                 "--threads", "1", "--summary", str(summary)], env=env, stderr=subprocess.PIPE, text=True)
    done = threading.Event()
    try:
        def agent1() -> psutil.Process | None:
            return next((p for r, p in agents_under(launcher.pid) if r == 1), None)

        slow = wait_until(agent1, 120, what="agent 1 to start")
        # Runs a quarter of the time: 4x slower compute on an idle machine. Periods of many scheduler ticks:
        # with short ones a loaded machine's scheduler hands a woken process back most of what it lost.
        cycler = threading.Thread(target=_duty_cycle, args=(slow, 0.15, 0.05, done), daemon=True)
        cycler.start()
        _, err = launcher.communicate(timeout=540)
        assert launcher.returncode == 0, err[-3000:]
    finally:
        done.set()
        if launcher.poll() is None:
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=30)
    agents = json.loads(summary.read_text())["agents"]
    print(f"slowed agent 1 (run 1/4 of the time): {agents}")
    fast, slow_t = agents["0"], agents["1"]
    assert fast["hosted"] == slow_t["hosted"] == 2 and fast["steps"] >= 20 and slow_t["steps"] >= 20, agents
    per_fast, per_slow = fast["compute_s"] / fast["hosted"], slow_t["compute_s"] / slow_t["hosted"]
    # Imposed 4x; loose bounds for a shared, noisy machine (measured 1.7 for an imposed 3x at load 13: the
    # cycler's own sleeps overrun and the scheduler favours the woken process). Unslowed, the two agents'
    # ratio was 1.03 idle and 1.1 at load 14.
    assert 1.5 <= per_slow / per_fast <= 8.0, agents
    # The agents step in lockstep: the fast one spends the difference waiting in its collectives.
    assert fast["flush_s"] >= 0.5 * (slow_t["compute_s"] - fast["compute_s"]), agents
    assert fast["flush_s"] > slow_t["flush_s"], agents
