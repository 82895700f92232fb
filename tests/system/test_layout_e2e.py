"""Uneven layouts through real agents: `elasticd run --layout` and live re-layouts by
`--scale-at STEP:M:B1/B2/...` compute what the uniform layout computes, bitwise in deterministic mode,
and what DDP computes within round-off in default mode."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from run_faults import STEPS as RECOVERY_STEPS
from run_faults import kill_during_run
from util import JOBS, REFERENCE_WORKERS, Reference, assert_same_run, load_state, rel_diffs

JOB = str(JOBS / "resize_job.py")   # BatchNorm, dropout, AdamW, StepLR, clipping, ctx.private, loader order
WORKERS, STEPS = 8, 16


def run(tmp: Path, name: str, *args: str) -> dict:
    out = tmp / name
    out.mkdir()
    env = {**os.environ, "ELASTICD_TEST_WORKERS": str(WORKERS), "ELASTICD_TEST_STEPS": str(STEPS),
           "ELASTICD_TEST_DETERMINISTIC": "1", "ELASTICD_TEST_LOG": str(out), "ELASTICD_TEST_OUT": str(out / "final.pt")}
    proc = subprocess.run([sys.executable, "-m", "elasticd", "run", JOB, "--summary", str(out / "summary.json"), *args],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((out / "summary.json").read_text())


@pytest.fixture(scope="module")
def uniform(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("uniform")
    run(tmp, "run", "--devices", "2")
    return tmp / "run"


@pytest.mark.slow
def test_a_6_2_layout_is_bitwise_the_uniform_one(uniform: Path, tmp_path: Path) -> None:
    summary = run(tmp_path, "six-two", "--devices", "2", "--layout", "6,2")
    assert summary["blocks"] == [6, 2]
    assert_same_run(tmp_path / "six-two", uniform, STEPS, ranks=WORKERS)


@pytest.mark.slow
def test_live_relayouts_from_1_7_through_grow_shrink_and_same_size_changes_are_bitwise_the_uniform_run(
        uniform: Path, tmp_path: Path) -> None:
    # 1/7 -> 1/3/4 (a grow: the joiner learns the layout from agent 0) -> 4/4 (a shrink) -> 6/2 -> 2/6
    # (live re-layouts: the same two agents, ranks moved between them).
    summary = run(tmp_path, "moves", "--devices", "2", "--layout", "1,7",
                  "--scale-at", "2:3:1/3/4,5:2,8:2:6/2,11:2:2/6")
    done = [(r["from"], r["to"], r["blocks"], r["outcome"]) for r in summary["resizes"]]
    assert done == [(2, 3, [1, 3, 4], "done"), (3, 2, [], "done"), (2, 2, [6, 2], "done"), (2, 2, [2, 6], "done")]
    assert summary["blocks"] == [2, 6]
    assert_same_run(tmp_path / "moves", uniform, STEPS, ranks=WORKERS)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_default_mode_on_a_3_1_layout_matches_ddp(ddp_reference: Callable[[str], Reference], tmp_path: Path) -> None:
    ref = ddp_reference("cnn_bn")   # rank 0's BatchNorm buffers win: agent 0 hosts three ranks here
    out = tmp_path / "final.pt"
    env = {**os.environ, "ELASTICD_TEST_WORKERS": str(REFERENCE_WORKERS), "ELASTICD_TEST_OUT": str(out)}
    proc = subprocess.run([sys.executable, "-m", "elasticd", "run", str(JOBS / "cnn_bn.py"), "--workers",
                           str(REFERENCE_WORKERS), "--devices", "2", "--layout", "3,1"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = rel_diffs(ref.final, load_state(out))
    assert max(diffs.values()) <= 1e-5, diffs


@pytest.mark.parametrize("args, why", [
    (["--devices", "2", "--layout", "6,3"], "sum to 9, not the 8"),
    (["--devices", "2", "--layout", "8,0"], "at least one"),
    (["--devices", "2", "--layout", "4,2,2"], "3 block sizes"),
    (["--devices", "2", "--layout", "six"], "not a list of block sizes"),
    (["--devices", "2", "--scale-at", "3:2:5/2"], "sum to 7"),
    (["--devices", "2", "--scale-at", "3:2:4-4"], "not block sizes"),
])
def test_a_bad_layout_is_a_usage_error_naming_it(args: list[str], why: str, tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "elasticd", "run", JOB, "--workers", str(WORKERS), *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and why in proc.stderr, proc.stderr


@pytest.mark.slow
def test_an_agent_killed_after_a_relayout_recovers_on_the_layout_the_job_had(
        undisturbed: Path, tmp_path: Path) -> None:
    # 4 ranks: 3/1, re-laid out live to 1/3 after step 4; agent 1 (three ranks) killed after 13 steps. The
    # restart restores the newest periodic snapshot onto 1/3 and ends bitwise as the uniform 2/2 run.
    out, summary, log = kill_during_run(tmp_path, rank=1, after_steps=13, sig=signal.SIGKILL,
                                         args=["--layout", "3,1", "--scale-at", "4:2:1/3", "--snapshot-every", "5"])
    assert "agent 1 was killed by SIGKILL" in log, log[-3000:]
    assert [(r["to"], r["blocks"], r["outcome"]) for r in summary["resizes"]] == [(2, [1, 3], "done")]
    assert summary["blocks"] == [1, 3] and len(summary["recoveries"]) == 1, summary
    assert_same_run(out, undisturbed, RECOVERY_STEPS, ranks=4, recovered=True)
