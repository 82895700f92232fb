"""Jobs submitted to a test daemon (tests/support/cluster.py): tests/jobs/resize_job.py's environment, paced
until released; submitting it or the fake agent; waiting for a resize's outcome in `elasticd status --json`."""

from __future__ import annotations

from pathlib import Path

from cluster import status
from util import JOBS, cli, wait_until

JOB = str(JOBS / "resize_job.py")
FAKE_SCRIPT = str(JOBS / "fake_agent.py")
STEPS = 300
PACE_S = "0.1"   # per logical step until released: 300 steps take >= 30 s on 4 devices, 120 s on 1


def job_env(out: Path, steps: int = STEPS, workers: int = 4) -> dict[str, str]:
    return {"ELASTICD_TEST_LOG": str(out), "ELASTICD_TEST_OUT": str(out / "final.pt"),
            "ELASTICD_TEST_STEPS": str(steps), "ELASTICD_TEST_DETERMINISTIC": "1",
            "ELASTICD_TEST_RELEASE": str(out / "release"), "ELASTICD_TEST_PACE_S": PACE_S,
            "ELASTICD_TEST_WORKERS": str(workers)}


def submit(sd: Path, script: str, env: dict[str, str], *args: str) -> str:
    envs = [x for k, v in env.items() for x in ("--env", f"{k}={v}")]
    r = cli("submit", script, "--state-dir", str(sd), *envs, *args)
    assert r.code == 0, (r.code, r.out, r.err)
    return r.out.strip()


def job_info(sd: Path, job: str) -> dict:
    return status(sd, job)["jobs"][0]


def wait_resized(sd: Path, job: str, count: int, timeout: float = 120.0) -> dict:
    """The job's state once its `count`-th resize has an outcome (and no other is in flight)."""
    def check() -> dict | None:
        info = job_info(sd, job)
        if info["state"] in ("failed", "finished", "stopped"):
            raise AssertionError(f"job {job} ended ({info['state']}) while resizing: {info['error']} "
                                 f"{info['resizes']}")
        return info if len(info["resizes"]) >= count and info["resizing"] is None else None
    return wait_until(check, timeout, interval=0.1, what=f"resize #{count} of {job}")


def submit_fake(sd: Path, *args: str, **env: str) -> str:
    envs = [x for k, v in env.items() for x in ("--env", f"{k}={v}")]
    r = cli("submit", FAKE_SCRIPT, "--state-dir", str(sd), *envs, *args)
    assert r.code == 0, (r.code, r.out, r.err)
    return r.out.strip()
