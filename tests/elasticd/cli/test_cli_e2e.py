"""End to end with the real agent runtime: jobs submitted through the CLI to real daemons compute
exactly what `elasticd run` computes, on one node and spread over two."""

from __future__ import annotations

import pytest
from cluster import status, wait_state
from util import JOBS, REPO, load_state, max_rel_diff, wait_until
from util import cli_process as cli  # the CLI as a shell runs it: an interpreter of its own

SCRIPT = str(JOBS / "mlp_sgd.py")
WORKERS, DEVICES = 4, 2


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """`elasticd run` of the same script on the same N and M."""
    out = tmp_path_factory.mktemp("ref") / "final.pt"
    r = cli("run", SCRIPT, "--workers", str(WORKERS), "--devices", str(DEVICES),
            env={"ELASTICD_TEST_OUT": str(out)}, timeout=300)
    assert r.code == 0, r.err[-3000:]
    return load_state(out)


def assert_same(reference, path):
    got = load_state(path)
    assert set(got) == set(reference)
    assert max_rel_diff(reference, got) <= 1e-6


@pytest.mark.slow
def test_submitted_job_equals_elasticd_run(cluster, tmp_path, reference):
    d = cluster.daemon(cpu=DEVICES, fake=False)
    out = tmp_path / "final.pt"
    r = cli("submit", SCRIPT, "--workers", str(WORKERS), "--min-devices", str(DEVICES), "--wait",
            "--env", f"ELASTICD_TEST_OUT={out}", "--state-dir", str(d.state_dir), timeout=300)
    assert r.code == 0, (r.out, r.err, d.output()[-3000:])
    job = r.out.split()[0]
    info = status(d.state_dir, job)["jobs"][0]
    assert info["state"] == "finished" and info["devices"] == DEVICES
    assert info["step"] > 0 and isinstance(info["metrics"].get("loss"), float)
    assert_same(reference, out)


@pytest.mark.slow
def test_one_job_spans_two_nodes_of_one_scheduler(cluster, tmp_path, reference):
    sched = cluster.scheduler()
    nodes = [cluster.node(sched, name, fake=False) for name in ("a", "b")]
    wait_until(lambda: len(status(sched.state_dir)["nodes"]) == 2, 90, what="both nodes to join")
    out = tmp_path / "final.pt"
    r = cli("submit", SCRIPT, "--workers", str(WORKERS), "--min-devices", str(DEVICES),
            "--env", f"ELASTICD_TEST_OUT={out}", "--state-dir", str(nodes[0].state_dir))
    assert r.code == 0, r.err
    job = r.out.strip()
    info = wait_state(sched.state_dir, job, ("finished", "failed"), timeout=240)
    assert info["state"] == "finished", (info, [n.output()[-2000:] for n in nodes])
    assert sorted(info["nodes"]) == sorted(n.info()["node_id"] for n in nodes)
    assert sorted(a["node"] for a in info["agents"]) == sorted(info["nodes"])
    assert_same(reference, out)
    # each node keeps its own agent's log; `logs` on either node shows both, fetched through the scheduler
    for n in nodes:
        logs = cli("logs", job, "--state-dir", str(n.state_dir))
        assert logs.code == 0, logs.err
        for rank in (0, 1):
            ranks = f"ranks {2 * rank}-{2 * rank + 1}"   # N=4 on 2 agents
            assert f"[agent {rank}, {ranks}] === elasticd: job {job} agent {rank}/2" in logs.out
    rank_of = {a["node"]: a["rank"] for a in info["agents"]}
    for n in nodes:
        rank = rank_of[n.info()["node_id"]]
        assert [p.name for p in (n.state_dir / "logs" / job).iterdir()] == [f"rank{rank}.log"]


@pytest.mark.slow
def test_worker_traceback_reaches_the_cli(cluster):
    d = cluster.daemon(cpu=2, fake=False)
    r = cli("submit", str(REPO / "tests" / "jobs" / "raises.py"), "--workers", "4", "--min-devices", "2",
            "--wait", "--state-dir", str(d.state_dir), timeout=300)
    assert r.code == 1, (r.out, r.err)
    assert "DeliberateFailure" in r.err and "deliberate failure on logical rank 2" in r.err
    job = r.out.split()[0]
    info = wait_state(d.state_dir, job, "failed")
    assert info["error"]["logical_rank"] == 2 and "Traceback" in info["error"]["traceback"]


@pytest.mark.slow
@pytest.mark.parametrize("env", [[], ["--env", "ELASTICD_TEST_UNSAVABLE=1"]], ids=["plain", "state_not_carried"])
def test_stop_reaches_the_real_runtime_which_stops_at_a_step_boundary(cluster, env):
    # A stop copies nothing: a state no resize could carry does not turn it into a failure.
    d = cluster.daemon(cpu=2, fake=False)
    r = cli("submit", str(REPO / "tests" / "jobs" / "long_job.py"), "--min-devices", "2", *env,
            "--state-dir", str(d.state_dir))
    assert r.code == 0, r.err
    job = r.out.strip()
    wait_state(d.state_dir, job, "running", timeout=120)
    live = wait_until(lambda: (j := status(d.state_dir, job)["jobs"][0])["step"] > 5 and j["steps_per_s"] > 0 and j,
                      120, what="progress from the agents")
    assert isinstance(live["metrics"]["loss"], float) and live["workers"] == 4 and live["devices"] == 2
    assert cli("stop", job, "--state-dir", str(d.state_dir)).code == 0
    agents = wait_until(lambda: (a := status(d.state_dir, job)["jobs"][0]["agents"]) and all(
        not x["alive"] for x in a) and a, 60, what="agents to exit")
    # exit 0: they obeyed the stop command at a step boundary instead of being SIGTERMed after the grace period
    assert [a["exitcode"] for a in agents] == [0, 0], agents
    assert status(d.state_dir, job)["jobs"][0]["state"] == "stopped"
