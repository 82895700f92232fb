"""Shared fixtures: the real-DDP reference result of each equivalence job, computed once per session, and
the daemons/schedulers of one control-plane test."""

from __future__ import annotations

import os
import pwd
from collections.abc import Callable

import pytest
from cluster import Cluster
from util import JOBS, REFERENCE_WORKERS, Reference, load_state

from elasticd.agent.ddp_reference import run_native_ddp

# Every daemon a test starts runs its jobs as the user running the suite: as root, a daemon would run them as
# elasticd-job, which cannot read the scripts and outputs the tests keep in pytest's owner-only tmp dirs.
# tests/test_security_run_as.py runs jobs as other users, and its daemons say so themselves.
os.environ["ELASTICD_JOBS_AS"] = pwd.getpwuid(os.geteuid()).pw_name


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Reference]:
    """`ddp_reference(job)` runs tests/jobs/<job>.py under torch DDP with 4 gloo processes (once per job)."""
    cache: dict[str, Reference] = {}

    def get(job: str) -> Reference:
        if job not in cache:
            out = tmp_path_factory.mktemp(f"ddp_{job}")
            env = {"ELASTICD_TEST_WORKERS": str(REFERENCE_WORKERS),
                   "ELASTICD_TEST_OUT": str(out / "final.pt"), "ELASTICD_TEST_INIT": str(out / "init.pt")}
            code = run_native_ddp(str(JOBS / f"{job}.py"), None, REFERENCE_WORKERS, env=env, timeout=300)
            assert code == 0, f"reference DDP run of {job} failed with exit code {code} (rank output above)"
            cache[job] = Reference(initial=load_state(out / "init.pt"), final=load_state(out / "final.pt"))
        return cache[job]

    return get


@pytest.fixture
def cluster(tmp_path):
    """Daemons and schedulers a test starts (tests/cluster.py), stopped when it ends."""
    c = Cluster(tmp_path)
    yield c
    c.cleanup()
