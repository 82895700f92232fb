"""deploy/slurm/elasticd.sbatch on a real Slurm (tests/support/slurm_island.py): a node whose Slurm name is not its
host name, a scheduler key with `$` in it, script arguments after `--`, a daemon that cannot start, and
`scancel` mid-training. Skipped with the reason where Slurm cannot run (not installed, not root)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from slurm_island import SlurmIsland, missing, processes_with
from util import REPO, wait_until

from elasticd import keys
from elasticd.ports import free_port

RECIPE = REPO / "deploy" / "slurm" / "elasticd.sbatch"
JOB = '''
import argparse, json, time
import torch
import elasticd

@elasticd.elastic(workers=2)
def train(ctx):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out"); ap.add_argument("--steps", type=int); ap.add_argument("--pace", type=float, default=0)
    a = ap.parse_args()
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ctx.replicate(model, opt)
    for step in ctx.steps(a.steps):
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        time.sleep(a.pace)
    if ctx.rank == 0:
        with open(a.out, "w") as f:
            json.dump({"steps": step + 1}, f)

if __name__ == "__main__":
    train()
'''

pytestmark = [pytest.mark.slow, pytest.mark.skipif(missing() is not None, reason=str(missing()))]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    island = SlurmIsland(tmp_path_factory.mktemp("slurm"))
    try:
        try:
            island.start()
        except (RuntimeError, subprocess.SubprocessError, OSError) as e:   # installed, but cannot run here
            pytest.skip(f"a real Slurm could not start on this machine: {e}"[:500])
        yield island
    finally:
        island.stop()


@pytest.fixture
def tmp_path(tmp_path_factory: pytest.TempPathFactory):
    """A short directory: the island's state dir holds Unix sockets, whose paths may not pass 107 bytes
    (pytest's own tmp_path under xdist comes close)."""
    import shutil
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="elsl", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _run(slurm: SlurmIsland, tmp: Path, *submit_args: str, start_opts: str = "--cpu-devices 2") -> tuple[str, Path]:
    script = tmp / "job.py"
    script.write_text(JOB)
    out = tmp / "slurm.out"
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "ELASTICD_SLURM_STATE": str(tmp / "island"),
           "ELASTICD_PORT": str(free_port()), "ELASTICD_METRICS_PORT": str(free_port()),
           "ELASTICD_START_OPTS": start_opts, "ELASTICD_JOIN_TIMEOUT": "60"}
    job = slurm.sbatch("--nodes=1", f"--output={out}", str(RECIPE), str(script), *submit_args, env=env)
    return job, out


def test_a_job_trains_to_its_end_with_a_dollar_key_and_script_arguments(slurm: SlurmIsland, tmp_path: Path) -> None:
    """A scheduler key with `$` (a quarter of Z85 keys) reaches the daemon intact, the node joins under its
    Slurm name although its host name differs, and `--` does not make `--wait` the script's."""
    sched = tmp_path / "island" / "scheduler"
    sched.parent.mkdir(mode=0o700)
    while "$" not in keys.ensure_identity(sched, force=True)[0].decode():
        pass
    result = tmp_path / "result.json"
    job, out = _run(slurm, tmp_path, "--workers", "2", "--", "--out", str(result), "--steps", "20")
    assert slurm.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 120) == "COMPLETED", out.read_text()
    assert json.loads(result.read_text()) == {"steps": 20}, out.read_text()
    assert "finished" in out.read_text()


def test_a_daemon_that_cannot_start_fails_the_slurm_job_at_once_with_the_reason(slurm: SlurmIsland,
                                                                                 tmp_path: Path) -> None:
    started = time.monotonic()
    job, out = _run(slurm, tmp_path, "--workers", "2", "--", "--out", str(tmp_path / "r.json"), "--steps", "5",
                    start_opts="--cpu-devices 0")
    assert slurm.wait_job(job, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), 90) == "FAILED", out.read_text()
    assert time.monotonic() - started < 45
    text = out.read_text()
    assert "a node daemon exited" in text and "--cpu-devices" in text, text


def test_scancel_mid_training_leaves_nothing_running_within_seconds(slurm: SlurmIsland, tmp_path: Path) -> None:
    job, out = _run(slurm, tmp_path, "--workers", "2", "--", "--out", str(tmp_path / "r.json"), "--steps", "100000",
                    "--pace", "0.01")
    events = tmp_path / "island" / "events.log"
    wait_until(lambda: events.exists() and "started" in events.read_text(), 90, what="the job to start training")
    procs = processes_with("SLURM_JOB_ID", job)
    assert any("elasticd" in " ".join(p.cmdline()) for p in procs), [p.cmdline() for p in procs]
    cancelled = time.monotonic()
    subprocess.run(["scancel", job], env=slurm.env, check=True)
    slurm.wait_job(job, ("CANCELLED", "GONE"), 30)
    took = time.monotonic() - cancelled
    alive = wait_until(lambda: not [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], 30,
                       what="every process of the job to exit")
    assert alive and took < 15, f"the job took {took:.1f}s to leave after scancel (KillWait is 30s)"
