"""An `elasticd run` of tests/jobs/resize_job.py left undisturbed (the reference of a recovery), and one
whose agent of a given rank is sent a signal once the job has made some steps (tests/jobs/resize_job.py's
log says which steps ran)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from util import JOBS, consumed, shared_servers, wait_until

from elasticd.agent.proc_name import agents_under

JOB = str(JOBS / "resize_job.py")
STEPS = 40


def run_env(out: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "ELASTICD_TEST_LOG": str(out), "ELASTICD_TEST_OUT": str(out / "final.pt"),
            "ELASTICD_TEST_STEPS": str(STEPS), "ELASTICD_TEST_DETERMINISTIC": "1", **extra}


def run_command(out: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "elasticd", "run", JOB, "--devices", "2", "--summary", str(out / "summary.json"),
            *args]


def agent_of_rank(launcher: subprocess.Popen, rank: int) -> psutil.Process:
    return wait_until(lambda: next((p for r, p in agents_under(launcher.pid) if r == rank), None), 120,
                      what=f"agent {rank}")


def steps_done(out: Path) -> int:
    try:
        return len(consumed(out, 0))
    except (OSError, ValueError, IndexError):
        return 0


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("undisturbed")
    proc = subprocess.run(run_command(out, "--snapshot-every", "0"), env=run_env(out, **shared_servers()),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def kill_during_run(tmp_path: Path, rank: int, after_steps: int, sig: int, args: list[str]
                     ) -> tuple[Path, dict, str]:
    """Run the job paced (so it is surely still training), SIGKILL agent `rank` once `after_steps` steps ran."""
    out = tmp_path / "run"
    out.mkdir()
    release = out / "release"   # absent while the job is paced; created once the fault is in
    with open(out / "stderr", "wb") as err:
        proc = subprocess.Popen(run_command(out, *args), env=run_env(out, ELASTICD_TEST_RELEASE=str(release),
                                                           ELASTICD_TEST_PACE_S="0.05"),
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        wait_until(lambda: steps_done(out) >= after_steps, 300, what=f"{after_steps} steps")
        agent_of_rank(proc, rank).send_signal(sig)
        wait_until(lambda: "restarting on" in (out / "stderr").read_text(), 120, what="the restart")
        release.touch()
        assert proc.wait(timeout=600) == 0, (out / "stderr").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    return out, json.loads((out / "summary.json").read_text()), (out / "stderr").read_text()


def grow_with_a_joiner_killed(cmd: list[str], env: dict[str, str], out: Path, hold: Path, snaps: Path) -> None:
    """Run `elasticd run` (`cmd`: a 2 -> 4 grow at a --scale-at step, `hold` keeping the job at a later step)
    and kill a joiner in the hand-over; returns once the run ended 0 (its stderr in `out`).

    The go: a warm joiner takes its rank's name ("elasticd r2", an "elasticd spare" until then) when its join
    command comes. It is frozen then, before the hand-over, so that the group cannot re-form (the run's own
    "agents told to hand over" line comes up to a status read later, when the group may have), and killed
    once every part of the resize's snapshot is saved."""
    with open(out / "stderr", "wb") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        joiner = wait_until(lambda: next((p for r, p in agents_under(proc.pid) if r is not None and r >= 2), None),
                            300, interval=0.005, what="a joiner's join command")
        joiner.suspend()
        hold.unlink()
        wait_until(lambda: len(os.listdir(snaps / "e1")) == 5 if (snaps / "e1").exists() else False, 120,
                   what="every part of the snapshot to be saved")
        joiner.kill()
        assert proc.wait(timeout=600) == 0, (out / "stderr").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
