"""A standalone scheduler with a node daemon joined over CURVE TCP: the scheduler is SIGKILLed and
restarted on the same state dir and port; the job table, and the running job, survive."""

from __future__ import annotations

from cluster import status, wait_state
from util import JOBS, cli, cli_here, wait_until

FAKE_SCRIPT = str(JOBS / "fake_agent.py")


def test_scheduler_killed_and_restarted_keeps_the_job_table(cluster, tmp_path):
    sched = cluster.scheduler()
    endpoint = sched.info()["tcp"]
    node = cluster.node(sched, "node", cpu=2)
    sd = node.state_dir

    def submit(*args: str) -> str:
        r = cli("submit", FAKE_SCRIPT, "--state-dir", str(sd), *args)
        assert r.code == 0, r.err
        return r.out.strip()

    done = submit("--workers", "1", "--min-devices", "1", "--max-devices", "1", "--wait")
    done = done.splitlines()[0]
    running = submit("--workers", "2", "--min-devices", "1", "--max-devices", "1", "--env", "FAKE_MODE=hang")
    wait_state(sd, running, "running")
    blocked = submit("--workers", "2", "--min-devices", "2", "--priority", "3")
    stopped = submit("--workers", "1")
    assert cli("stop", stopped, "--state-dir", str(sd)).code == 0
    before = {j["job_id"]: j["state"] for j in status(sd)["jobs"]}
    assert before == {done: "finished", running: "running", blocked: "queued", stopped: "stopped"}

    sched.kill()                                   # SIGKILL: no chance to flush anything
    r = cli("status", "--state-dir", str(sd), "--timeout", "10")
    assert r.code == 1 and "scheduler" in r.err    # the daemon answers, with a typed error
    sched.argv[sched.argv.index("--bind") + 1] = endpoint
    sched.start()                                  # same state dir, same port
    assert sched.info()["tcp"] == endpoint

    # the node notices (unknown_node), says hello again with its running job, and is back in the table
    wait_until(lambda: cli_here("status", "--json", "--state-dir", str(sd)).code == 0
               and status(sd)["nodes"], 30, what="node to rejoin the restarted scheduler")
    after = {j["job_id"]: j["state"] for j in status(sd)["jobs"]}
    assert after == before
    # the standalone scheduler also answers on its own state dir's socket
    assert {j["job_id"] for j in status(sched.state_dir)["jobs"]} == set(before)
    # and it keeps driving the jobs: stopping the running one lets the queued one start
    assert cli("stop", running, "--state-dir", str(sd)).code == 0
    wait_state(sd, blocked, ("running", "finished"))
    nxt = submit("--workers", "1")
    assert nxt not in before
    # `elasticd shutdown` on the scheduler's state dir stops it; the node is left waiting for it
    r = cli("shutdown", "--state-dir", str(sched.state_dir))
    assert r.code == 0 and "shutting down" in r.out
    assert sched.popen.wait(timeout=30) == 0
    assert not (sched.state_dir / "scheduler.sock").exists()
    assert node.popen.poll() is None
