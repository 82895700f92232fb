"""Shared fixtures: warm fork servers for the session's runs, the real-DDP reference result of each
equivalence job (computed once per session), and the daemons/schedulers of one control-plane test."""

from __future__ import annotations

import os
import pwd
import subprocess
from collections.abc import Callable, Iterator

import pytest
import util
from cluster import Cluster
from util import JOBS, REFERENCE_WORKERS, Reference, load_state

from elasticd.core.commands import module_command
from elasticd.daemon.processes import agent_env
from elasticd.forked import SHARED_DIR_VAR, supported
from elasticd.reference_launch import rank_environment, run_native_ddp

# Every daemon a test starts runs its jobs as the user running the suite: as root, a daemon would run them as
# elasticd-job, which cannot read the scripts and outputs the tests keep in pytest's owner-only tmp dirs.
# tests/elasticd/daemon/test_security_run_as.py runs jobs as other users, and its daemons say so themselves.
os.environ["ELASTICD_JOBS_AS"] = pwd.getpwuid(os.geteuid()).pw_name

# Fixtures shared by tests in different directories live in tests/support/ beside the helpers they use.
pytest_plugins = ["run_faults"]


@pytest.fixture(scope="session", autouse=True)
def shared_fork_servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """One warm fork server per kind for this test process (agent/forkserver.py --listen): the suite's
    `elasticd run`s (through util.cli), DDP references and the spares of daemons that run real agents
    (cluster.Cluster.daemon) take their servers from them instead of each importing torch again, seconds of
    CPU per run or daemon. Tests that look at a run's processes opt out."""
    if not supported():
        yield ""
        return
    where = tmp_path_factory.mktemp("forkservers")
    daemons = where / "daemons"   # for daemons' spares: started with the environment a daemon gives its agents
    daemons.mkdir()
    with open(where / "servers.log", "ab") as log:
        servers = [subprocess.Popen([*module_command("elasticd.agent.forkserver"), "--listen",
                                     str(place / f"{kind}.sock"), kind], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True, env=env)
                   for place, kind, env in ((where, "agent", dict(os.environ)), (where, "reference", rank_environment()),
                                            (daemons, "agent", agent_env({})))]
    util.SHARED_FORK_SERVERS, util.SHARED_DAEMON_FORK_SERVERS = str(where), str(daemons)
    yield str(where)
    util.SHARED_FORK_SERVERS = util.SHARED_DAEMON_FORK_SERVERS = ""
    for server in servers:
        server.kill()
        server.wait()


@pytest.fixture(scope="session")
def ddp_reference(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Reference]:
    """`ddp_reference(job)` runs tests/jobs/<job>.py under torch DDP with 4 gloo processes (once per job)."""
    cache: dict[str, Reference] = {}

    def get(job: str) -> Reference:
        if job not in cache:
            out = tmp_path_factory.mktemp(f"ddp_{job}")
            env = {"ELASTICD_TEST_WORKERS": str(REFERENCE_WORKERS), SHARED_DIR_VAR: util.SHARED_FORK_SERVERS,
                   "ELASTICD_TEST_OUT": str(out / "final.pt"), "ELASTICD_TEST_INIT": str(out / "init.pt")}
            code = run_native_ddp(str(JOBS / f"{job}.py"), None, REFERENCE_WORKERS, env=env, timeout=300)
            assert code == 0, f"reference DDP run of {job} failed with exit code {code} (rank output above)"
            cache[job] = Reference(initial=load_state(out / "init.pt"), final=load_state(out / "final.pt"))
        return cache[job]

    return get


@pytest.fixture
def cluster(tmp_path):
    """Daemons and schedulers a test starts (tests/support/cluster.py), stopped when it ends."""
    c = Cluster(tmp_path)
    yield c
    c.cleanup()
