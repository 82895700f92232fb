"""Speed-aware placement end to end: a real daemon (embedded scheduler), real agents, one of them made
really slower, the job re-laid-out live, and still bitwise the run that was never disturbed.

The job (tests/jobs/resize_job.py, N=8, deterministic) runs on 2 CPU devices, paced (each logical
worker-step also sleeps) until the test releases it. The test duty-cycles the agent of rank 1 with
SIGSTOP/SIGCONT (its pid from `status --json`), so that agent gets through its workers at roughly half
the speed of the other; nothing tells the scheduler which one is slow. It must learn it from the agents'
timing reports (fitted speeds in about the imposed ratio), move logical workers to the fast agent through
the resize path, and the job must end with the parameters, steps and samples of an `elasticd run` of the
same job on the uniform layout, never slowed.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
from cluster import status, wait_state
from util import JOBS, assert_same_run, cli, wait_until

JOB = str(JOBS / "resize_job.py")
STEPS = 80
WORKERS = 8
STOP_S = 0.08   # SIGSTOP this long, then SIGCONT as long: about half speed (the paced sleeps go on while
RUN_S = 0.08    # stopped, so a little more than half; the test's bounds are loose for that and for load)


def job_env(out: Path) -> dict[str, str]:
    return {"ELASTICD_TEST_LOG": str(out), "ELASTICD_TEST_OUT": str(out / "final.pt"),
            "ELASTICD_TEST_STEPS": str(STEPS), "ELASTICD_TEST_DETERMINISTIC": "1",
            "ELASTICD_TEST_RELEASE": str(out / "release"), "ELASTICD_TEST_PACE_S": "0.02",
            "ELASTICD_TEST_WORKERS": str(WORKERS)}


class DutyCycle:
    """SIGSTOP/SIGCONT one process from a thread until stopped (then it is left running)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> DutyCycle:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self._stop.wait(STOP_S)
                os.kill(self.pid, signal.SIGCONT)
                self._stop.wait(RUN_S)
        except ProcessLookupError:
            return
        finally:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


@pytest.fixture(scope="module")
def uniform_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`elasticd run` of the job on 2 devices, uniform layout, released from the start, never slowed."""
    out = tmp_path_factory.mktemp("uniform")
    (out / "release").touch()
    r = cli("run", JOB, "--devices", "2", env=job_env(out), timeout=600)
    assert r.code == 0, r.err[-3000:]
    return out


@pytest.mark.slow
def test_a_slowed_agent_is_learned_and_the_job_re_laid_out_live_bitwise_the_uniform_run(cluster, tmp_path,
                                                                                       uniform_run):
    d = cluster.daemon(cpu=2, fake=False)
    sd = d.state_dir
    out = tmp_path / "slowed"
    out.mkdir()
    envs = [x for k, v in job_env(out).items() for x in ("--env", f"{k}={v}")]
    r = cli("submit", JOB, "--state-dir", str(sd), "--workers", str(WORKERS), "--min-devices", "2",
            "--max-devices", "2", *envs)
    assert r.code == 0, (r.code, r.out, r.err)
    job = r.out.strip()
    info = wait_state(sd, job, "running", timeout=120)
    assert info["blocks"] == []   # equal, unmeasured devices: the uniform layout of before
    slow = wait_until(lambda: next((a["pid"] for a in status(sd, job)["jobs"][0]["agents"]
                                    if a["rank"] == 1 and a["alive"]), None), 30, what="rank 1's pid")

    def relaid() -> dict | None:
        info = status(sd, job)["jobs"][0]
        if info["state"] in ("failed", "finished", "stopped"):
            raise AssertionError(f"job {job} ended ({info['state']}) before a re-layout: {info['error']}")
        done = [x for x in info["resizes"] if x.get("blocks_to") and x["outcome"] == "done"]
        return info if done and info["resizing"] is None else None

    with DutyCycle(slow):
        info = wait_until(relaid, 90, interval=0.2, what=f"a live re-layout of {job}")
        lay = info["layout"]["agents"]
        fast_speed, slow_speed = lay[0]["speed"], lay[1]["speed"]
    entry = next(x for x in info["resizes"] if x.get("blocks_to"))
    assert entry["blocks_from"] == [4, 4] and entry["from"] == entry["to"] == 2
    big, small = entry["blocks_to"]
    assert big + small == WORKERS and big > small, entry
    assert entry["predicted_gain"] >= 0.1 and "speeds drifted" in entry["reason"]
    assert info["blocks"] == entry["blocks_to"] and [a["workers"] for a in lay] == entry["blocks_to"]
    # The imposed ratio is about 2 (a little less: see STOP_S); loose bounds for a shared 2-core machine.
    assert 1.3 < fast_speed / slow_speed < 3.5, lay
    assert [a["pid"] for a in status(sd, job)["jobs"][0]["agents"] if a["rank"] == 1] == [slow]   # same agents
    (out / "release").touch()
    wait_state(sd, job, "finished", timeout=180)
    assert_same_run(out, uniform_run, STEPS, ranks=WORKERS)
