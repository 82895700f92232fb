"""Live resize through `elasticd run --scale-at`: same result as a run that never scaled, every step
and every sample exactly once per logical rank, private state carried over."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest
import torch
from run_faults import grow_with_a_joiner_killed
from util import JOBS, assert_same_run, consumed, max_rel_diff, shared_servers

from elasticd.core.records import ResizeEntry

JOB = str(JOBS / "resize_job.py")
STEPS = 40


def run(tmp: Path, name: str, devices: int, scale_at: str = "", deterministic: bool = True
        ) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp / name
    out.mkdir()
    env = {"ELASTICD_TEST_LOG": str(out), "ELASTICD_TEST_OUT": str(out / "final.pt"),
           "ELASTICD_TEST_STEPS": str(STEPS), "ELASTICD_TEST_DETERMINISTIC": "1" if deterministic else "0"}
    cmd = [sys.executable, "-m", "elasticd", "run", JOB, "--devices", str(devices),
           "--summary", str(out / "summary.json")]
    if scale_at:
        cmd += ["--scale-at", scale_at]
    proc = subprocess.run(cmd, env={**os.environ, **shared_servers(), **env}, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, out


@pytest.fixture(scope="module")
def unscaled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run(tmp_path_factory.mktemp("unscaled"), "run", devices=4)[1]


def test_scaling_4_2_1_4_is_bitwise_the_unscaled_run(unscaled: Path, tmp_path: Path) -> None:
    _, out = run(tmp_path, "scaled", devices=4, scale_at="5:2,12:1,20:4")
    resizes = json.loads((out / "summary.json").read_text())["resizes"]
    assert [(r["from"], r["to"]) for r in resizes] == [(4, 2), (2, 1), (1, 4)]
    assert all(r["seconds"] is not None for r in resizes), resizes
    assert_same_run(out, unscaled, STEPS, ranks=4)
    # Across ranks, each epoch is a permutation: no sample seen twice or skipped (10 steps an epoch).
    for epoch in range(STEPS // 10):
        idx = sorted(i for r in range(4) for s, b in consumed(out, r) if s // 10 == epoch for i in b)
        assert idx == list(range(400)), f"epoch {epoch} lost or repeated samples"


def test_default_mode_resize_matches_within_tolerance(tmp_path: Path) -> None:
    _, ref = run(tmp_path, "unscaled", devices=2, deterministic=False)
    _, out = run(tmp_path, "scaled", devices=2, scale_at="6:1,15:2", deterministic=False)
    assert len(json.loads((out / "summary.json").read_text())["resizes"]) == 2
    final = torch.load(out / "final.pt")
    assert max_rel_diff(torch.load(ref / "final.pt"), final) <= 1e-5
    assert [s for s, _ in consumed(out, 3)] == list(range(STEPS))


def test_scale_to_the_current_size_is_a_no_op(unscaled: Path, tmp_path: Path) -> None:
    proc, out = run(tmp_path, "same", devices=4, scale_at="5:4")
    assert json.loads((out / "summary.json").read_text())["resizes"] == []
    assert "already there" in proc.stderr
    ref, got = torch.load(unscaled / "final.pt"), torch.load(out / "final.pt")
    assert all(torch.equal(ref[k], got[k]) for k in ref)


@pytest.mark.slow
def test_an_agent_dying_mid_hand_over_rolls_back_and_the_run_ends_as_if_never_scaled(unscaled: Path,
                                                                                      tmp_path: Path) -> None:
    out, snaps = tmp_path / "fell-back", tmp_path / "snapshots"
    out.mkdir()
    hold = out / "hold"
    # The grow happens after step 5 (the agents wait there for it); the job then waits at the start of step 6,
    # its first at the new size, so the hand-over cannot be complete before the joiner is frozen.
    hold.touch()
    env = {**os.environ, "ELASTICD_TEST_LOG": str(out), "ELASTICD_TEST_OUT": str(out / "final.pt"),
           "ELASTICD_TEST_STEPS": str(STEPS), "ELASTICD_TEST_DETERMINISTIC": "1",
           "ELASTICD_TEST_HOLD": str(hold), "ELASTICD_TEST_HOLD_AT": "6"}
    cmd = [sys.executable, "-m", "elasticd", "run", JOB, "--devices", "2", "--scale-at", "5:4",
           "--snapshot-dir", str(snaps), "--summary", str(out / "summary.json")]
    grow_with_a_joiner_killed(cmd, env, out, hold, snaps)
    log = (out / "stderr").read_text()
    assert "during the resize 2 -> 4; restarting on 2 devices from the snapshot saved at its step boundary" in log, \
        log[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [(r["from"], r["to"], r["outcome"]) for r in summary["resizes"]] == [(2, 4, "rolled back")]
    assert set(summary["resizes"][0]) == set(ResizeEntry(0, 0, "", 0.0).to_dict())   # the scheduler's schema
    assert summary["devices"] == 2 and summary["exit"] == 0
    assert_same_run(out, unscaled, STEPS, ranks=4)
    assert os.listdir(snaps) == [], "the snapshot stays only until a step completed after the restart"


def test_a_run_sweeps_the_directories_of_killed_runs_and_leaves_its_own_none(tmp_path: Path) -> None:
    """Its resize snapshots (tmpfs: kept until a reboot) and its agents' error reports and beat files."""
    roots = {Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir()),
             Path(tempfile.gettempdir())}
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = [root / f"elasticd-run-{gone.pid}-killed" for root in roots]
    live = [root / f"elasticd-run-{os.getpid()}-running" for root in roots]
    for d in (*stale, *live):
        (d / "e1").mkdir(parents=True)

    def ours(root: Path) -> set[str]:
        return {p.name for p in root.glob("elasticd-run-*") if re.fullmatch(r"elasticd-run-\d+-\w+", p.name)}
    try:
        before = {root: ours(root) for root in roots}
        run(tmp_path, "sweeps", devices=2, scale_at="3:1")
        assert not any(d.exists() for d in stale), "a dead run's directory stays until a reboot unless swept"
        assert all(d.exists() for d in live), "a running run's directory must be left alone"
        # Other runs on this machine may have started meanwhile; a directory whose run is over is a leak.
        left = [name for root in roots for name in ours(root) - before[root]
                if not psutil.pid_exists(int(name.split("-")[2]))]
        assert left == [], "the run left its own directory behind"
    finally:
        for d in (*stale, *live):
            shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("bad", ["5:0", "5:9", "five:2", "5"])
def test_a_bad_schedule_is_a_usage_error(bad: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "elasticd", "run", JOB, "--workers", "4", "--devices", "2",
                           "--scale-at", bad], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--scale-at" in proc.stderr
