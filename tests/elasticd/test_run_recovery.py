"""Recovery under `elasticd run`: an agent that dies is not the job's failure. Every agent is stopped and the
job restarts from its newest complete periodic snapshot, ending bitwise equal (deterministic mode) to a run
nobody disturbed, with every step and sample kept exactly once; a worker that raises is not retried."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from run_faults import STEPS, agent_of_rank, kill_during_run, run_command, run_env, steps_done
from util import JOBS, assert_same_run, completed_twice, consumed, shared_servers, wait_until

from elasticd.core.records import Recovery


def test_a_killed_agent_restarts_the_job_from_its_snapshot_and_the_result_is_undisturbed(
        undisturbed: Path, tmp_path: Path) -> None:
    out, summary, log = kill_during_run(tmp_path, rank=1, after_steps=13, sig=signal.SIGKILL,
                                         args=["--snapshot-every", "5"])
    assert "agent 1 was killed by SIGKILL" in log, log[-3000:]
    [rec] = summary["recoveries"]
    # Snapshots after steps 5 and 10 (the next steps to run: 5, 10); the kill came at step 13 or later.
    assert rec["resumed_from"] % 5 == 0 and 10 <= rec["resumed_from"] <= rec["failed_after_step"] + 1, rec
    assert rec["steps_redone"] == rec["failed_after_step"] + 1 - rec["resumed_from"] <= 5 + 1, rec
    assert completed_twice(out) == list(range(rec["resumed_from"], rec["failed_after_step"] + 1)), rec
    assert rec["seconds"] > 0
    assert set(rec) == {f.name for f in dataclasses.fields(Recovery)}   # the scheduler's record, field for field
    assert_same_run(out, undisturbed, STEPS, ranks=4, recovered=True)
    for epoch in range(STEPS // 10):
        idx = sorted(i for r in range(4) for s, b in consumed(out, r, kept=True) if s // 10 == epoch for i in b)
        assert idx == list(range(400)), f"epoch {epoch} lost or repeated samples"


def test_a_stopped_agent_is_fenced_and_the_job_recovers_bitwise(undisturbed: Path, tmp_path: Path) -> None:
    """SIGSTOP, never continued: the watchdog sees the stopped process (elasticd/core/watchdog.py), kills it
    after --stuck-after, and the job recovers as from a killed agent instead of waiting on it for good."""
    out, summary, log = kill_during_run(tmp_path, rank=1, after_steps=13, sig=signal.SIGSTOP,
                                         args=["--snapshot-every", "5", "--stuck-after", "2"])
    assert re.search(r"agent 1 is stuck \(stopped[^)]*, --stuck-after 2s\); fencing it \(SIGKILL\)", log), log[-3000:]
    [rec] = summary["recoveries"]
    # the cause in the daemon's words (tests/elasticd/daemon/test_recovery_daemon.py)
    assert re.fullmatch(r"agent 1 was stuck \(stopped[^)]*, --stuck-after 2s\) and was fenced", rec["cause"]), rec
    # Held longer than the bound before it was fenced (`seconds` counts from there); kept to the millisecond.
    assert rec["detected_after"] >= 2.0, rec
    assert rec["steps_redone"] == rec["failed_after_step"] + 1 - rec["resumed_from"] <= 5 + 1, rec
    assert completed_twice(out) == list(range(rec["resumed_from"], rec["failed_after_step"] + 1)), rec
    assert_same_run(out, undisturbed, STEPS, ranks=4, recovered=True)


def test_an_agent_the_others_wait_for_is_fenced_and_a_slow_step_is_not(undisturbed: Path, tmp_path: Path) -> None:
    """At step 8 every rank takes 4 s (an evaluation: no agent waits for another, so none is stuck); at step 13
    logical rank 2 (agent 1) blocks for good while agent 0 waits for it in the gradient flush: agent 1 is
    fenced after --stuck-after and the job recovers, ending as if nothing happened."""
    out = tmp_path / "run"
    out.mkdir()
    env = run_env(out, ELASTICD_TEST_SLOW_AT="8", ELASTICD_TEST_SLOW_S="4", ELASTICD_TEST_HANG_AT="13",
               ELASTICD_TEST_HANG_RANK="2", ELASTICD_TEST_HANG_ONCE=str(out / "hung"), **shared_servers())
    proc = subprocess.run(run_command(out, "--snapshot-every", "5", "--stuck-after", "2"), env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "hung").exists()
    summary = json.loads((out / "summary.json").read_text())
    [rec] = summary["recoveries"]   # the hang; the slow step was no failure
    assert rec["cause"].startswith("agent 1 was stuck (1 other agent(s) waited ") and "it did not join" in rec["cause"], rec
    assert rec["failed_after_step"] == 12 and rec["resumed_from"] == 10, rec
    assert completed_twice(out) == [10, 11, 12] and rec["steps_redone"] == 3, rec
    assert "fencing it (SIGKILL)" in proc.stderr and proc.stderr.count("fencing it") == 1, proc.stderr[-3000:]
    assert_same_run(out, undisturbed, STEPS, ranks=4, recovered=True)


def test_without_snapshots_the_job_restarts_from_the_beginning_with_the_same_result(
        undisturbed: Path, tmp_path: Path) -> None:
    out, summary, _ = kill_during_run(tmp_path, rank=0, after_steps=6, sig=signal.SIGKILL,
                                   args=["--snapshot-every", "0"])
    [rec] = summary["recoveries"]
    assert rec["resumed_from"] == 0 and rec["steps_redone"] == rec["failed_after_step"] + 1
    assert completed_twice(out) == list(range(rec["failed_after_step"] + 1)), rec
    assert_same_run(out, undisturbed, STEPS, ranks=4, recovered=True)


def test_a_worker_that_raises_is_not_retried(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "elasticd", "run", str(JOBS / "raises.py"), "--devices", "2",
                           "--snapshot-every", "1", "--summary", str(tmp_path / "summary.json")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "restarting" not in proc.stderr
    assert json.loads((tmp_path / "summary.json").read_text())["recoveries"] == []


# A real-time signal has no name of its own (signal.Signals has none for SIGRTMIN+6).
@pytest.mark.parametrize("sig, words", [(signal.SIGKILL, "SIGKILL"), (signal.SIGRTMIN + 6, "signal 40")])
def test_restarts_stop_at_max_restarts(tmp_path: Path, sig: int, words: str) -> None:
    out = tmp_path / "run"
    out.mkdir()
    with open(out / "stderr", "wb") as err:
        proc = subprocess.Popen(run_command(out, "--max-restarts", "0"),
                                env=run_env(out, ELASTICD_TEST_RELEASE=str(out / "r"), ELASTICD_TEST_PACE_S="0.05"),
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_until(lambda: steps_done(out) >= 2, 300, what="2 steps")
        agent_of_rank(proc, 1).send_signal(sig)
        assert proc.wait(timeout=300) == 1
    finally:
        if proc.poll() is None:
            proc.kill()
    log = (out / "stderr").read_text()
    assert f"agent 1 was killed by {words}; not restarting: 0 restart(s) of --max-restarts 0 used" in log, log[-2000:]
