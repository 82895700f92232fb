"""A real node daemon (embedded scheduler) on loopback, driven through the CLI; agents are
tests/jobs/fake_agent.py (same command line and control channel as `python -m agent`, no torch)."""

from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
from cluster import status, wait_state
from daemon_jobs import submit_fake
from util import JOBS, cli, wait_until

FAKE_SCRIPT = str(JOBS / "fake_agent.py")  # any readable file will do


def ranks(out: Path) -> dict[int, dict]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in out.glob("rank*.json")}


def test_job_runs_to_finished_with_progress_logs_and_one_agent_per_device(cluster, tmp_path):
    d = cluster.daemon(cpu=2)
    out = tmp_path / "out"
    out.mkdir()
    job = submit_fake(d.state_dir, "--workers", "4", "--name", "demo", FAKE_OUT=str(out), FAKE_STEPS="20")
    info = wait_state(d.state_dir, job, "finished")
    assert info["devices"] == 2 and info["workers"] == 4 and info["name"] == "demo"
    assert info["step"] == 20 and info["metrics"]["loss"] == pytest.approx(1 / 20)
    seen = ranks(out)
    assert sorted(seen) == [0, 1]
    assert {tuple(r["device"]) for r in seen.values()} == {("cpu", 0), ("cpu", 1)}
    assert seen[0]["master"] == seen[1]["master"] and seen[0]["master"][1] > 0
    assert seen[0]["hosted"] == [0, 1] and seen[1]["hosted"] == [2, 3]
    assert all(not psutil.pid_exists(r["pid"]) or psutil.Process(r["pid"]).status() == psutil.STATUS_ZOMBIE
               for r in seen.values())
    logs = cli("logs", job, "--state-dir", str(d.state_dir))
    assert logs.code == 0
    # each line names its agent and the logical ranks that agent hosts
    assert "[agent 0, ranks 0-1] fake agent 0/2 of " + job in logs.out and "[agent 1, ranks 2-3] fake agent 1/2" in logs.out
    table = cli("status", "--state-dir", str(d.state_dir))
    assert table.code == 0 and job in table.out and "finished" in table.out and "0.05" in table.out
    assert status(d.state_dir)["nodes"][0]["free"] == ["cpu:0", "cpu:1"]


def test_failed_agent_fails_job_with_its_traceback_and_wait_exits_1(cluster):
    d = cluster.daemon(cpu=2)
    r = cli("submit", FAKE_SCRIPT, "--workers", "2", "--min-devices", "2", "--env", "FAKE_MODE=fail", "--wait",
            "--state-dir", str(d.state_dir))
    assert r.code == 1, (r.out, r.err)
    job = r.out.strip().splitlines()[0]
    assert "fake failure" in r.err and "Traceback (fake)" in r.err
    info = status(d.state_dir, job)["jobs"][0]
    assert info["state"] == "failed" and info["error"]["message"] == "ValueError: fake failure"
    assert info["error"]["host"] == "fakehost" and "node" in info["error"]
    detail = cli("status", job, "--state-dir", str(d.state_dir))
    assert "ValueError: fake failure" in detail.out and "Traceback (fake)" in detail.out
    assert "failing" in cli("logs", job, "--state-dir", str(d.state_dir)).out


def test_submit_wait_json_is_one_document_and_exit_0_when_finished(cluster):
    d = cluster.daemon(cpu=1)
    r = cli("submit", FAKE_SCRIPT, "--workers", "1", "--wait", "--json", "--state-dir", str(d.state_dir))
    assert r.code == 0, r.err
    doc = r.json()
    assert doc["state"] == "finished" and doc["step"] == 5


def test_stop_running_job_stops_agents_at_step_boundary_and_frees_devices(cluster, tmp_path):
    d = cluster.daemon(cpu=2)
    out = tmp_path / "out"
    out.mkdir()
    job = submit_fake(d.state_dir, "--workers", "2", FAKE_MODE="hang", FAKE_OUT=str(out))
    wait_state(d.state_dir, job, "running")
    agents = wait_until(lambda: [a for a in status(d.state_dir, job)["jobs"][0]["agents"] if a["rss"] > 0], 30,
                        what="psutil samples of the agents")
    assert len(agents) == 2 and all(a["alive"] and a["pid"] > 0 for a in agents)
    r = cli("stop", job, "--state-dir", str(d.state_dir))
    assert r.code == 0 and "stopped" in r.out
    assert status(d.state_dir, job)["jobs"][0]["state"] == "stopped"
    wait_until(lambda: len(ranks(out)) == 2, 20, what="both agents to exit")
    assert all(c["commands"] == [{"op": "stop"}] for c in ranks(out).values())
    wait_until(lambda: status(d.state_dir)["nodes"][0]["free"] == ["cpu:0", "cpu:1"], 20, what="devices freed")
    assert cli("stop", job, "--state-dir", str(d.state_dir)).out.strip().endswith("already stopped")


@pytest.mark.slow
def test_stop_escalates_to_sigterm_for_an_agent_that_ignores_it(cluster):
    d = cluster.daemon(cpu=1)
    job = submit_fake(d.state_dir, "--workers", "1", FAKE_MODE="deaf")
    info = wait_state(d.state_dir, job, "running")
    pid = info["agents"][0]["pid"] if info["agents"] else wait_until(
        lambda: status(d.state_dir, job)["jobs"][0]["agents"], 10)[0]["pid"]
    assert cli("stop", job, "--state-dir", str(d.state_dir)).code == 0
    wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, 20,
               what="deaf agent to be terminated")
    wait_until(lambda: status(d.state_dir)["nodes"][0]["free"] == ["cpu:0"], 10, what="device freed")


def test_two_jobs_share_devices_by_priority(cluster):
    d = cluster.daemon(cpu=3)
    sd = d.state_dir
    blocker = submit_fake(sd, "--workers", "3", "--min-devices", "3", FAKE_MODE="hang")
    wait_state(sd, blocker, "running")
    low = submit_fake(sd, "--workers", "2", "--priority", "0", "--name", "low", FAKE_MODE="hang")
    high = submit_fake(sd, "--workers", "2", "--priority", "5", "--name", "high", FAKE_MODE="hang")
    assert {j["job_id"]: j["state"] for j in status(sd)["jobs"]} == {
        blocker: "running", low: "queued", high: "queued"}
    assert cli("stop", blocker, "--state-dir", str(sd)).code == 0
    hi = wait_state(sd, high, "running")
    lo = wait_state(sd, low, "running")
    assert hi["devices"] == 2 and lo["devices"] == 1
    devs = [a["device"] for j in (hi, lo) for a in status(sd, j["job_id"])["jobs"][0]["agents"]]
    assert sorted(devs) == ["cpu:0", "cpu:1", "cpu:2"]


def test_scale_queued_job_fixes_its_device_count(cluster):
    d = cluster.daemon(cpu=2)
    sd = d.state_dir
    blocker = submit_fake(sd, "--workers", "2", "--min-devices", "2", FAKE_MODE="hang")
    wait_state(sd, blocker, "running")
    job = submit_fake(sd, "--workers", "4", FAKE_MODE="hang")
    r = cli("scale", job, "--devices", "1", "--state-dir", str(sd))
    assert r.code == 0 and "1 devices" in r.out
    assert cli("stop", blocker, "--state-dir", str(sd)).code == 0
    assert wait_state(sd, job, "running")["devices"] == 1
    # the blocker's agents exit and give both devices back; the job took one of them
    wait_until(lambda: len(status(sd)["nodes"][0]["free"]) == 1, 20, what="the blocker's other device")
    r = cli("scale", job, "--devices", "2", "--state-dir", str(sd))   # running now: a live resize
    assert r.code == 0 and "resizing 1 -> 2" in r.out
    info = wait_until(lambda: (j := status(sd, job)["jobs"][0])["resizes"] and j, 20, what="the resize")
    assert info["requested_devices"] == 2 and info["devices"] == 2 and info["state"] == "running"
    assert [(x["from"], x["to"], x["outcome"]) for x in info["resizes"]] == [(1, 2, "done")]


def test_logs_follow_streams_until_the_job_ends(cluster):
    d = cluster.daemon(cpu=1)
    job = submit_fake(d.state_dir, "--workers", "1", FAKE_STEPS="40", FAKE_STEP_S="0.05")
    r = cli("logs", "-f", job, "--state-dir", str(d.state_dir))
    assert r.code == 0, r.err
    assert f"[agent 0, rank 0] fake agent 0/1 of {job}" in r.out
    assert status(d.state_dir, job)["jobs"][0]["state"] == "finished"


def test_job_spans_two_daemons_sharing_one_scheduler(cluster, tmp_path):
    a = cluster.daemon("a", cpu=1)
    b = cluster.node(a, "b", endpoint_key="scheduler_tcp")
    wait_until(lambda: len(status(a.state_dir)["nodes"]) == 2, 90, what="node b to join")
    out = tmp_path / "out"
    out.mkdir()
    job = submit_fake(b.state_dir, "--workers", "4", "--min-devices", "2", FAKE_OUT=str(out), FAKE_STEPS="10")
    info = wait_state(a.state_dir, job, "finished")
    assert sorted(info["nodes"]) == sorted([a.info()["node_id"], b.info()["node_id"]])
    seen = ranks(out)
    assert seen[0]["master"] == seen[1]["master"] and seen[0]["world"] == seen[1]["world"] == 2
    for sd in (a.state_dir, b.state_dir):   # each node shows both agents' logs (one fetched remotely)
        r = cli("logs", job, "--state-dir", str(sd))
        assert r.code == 0 and f"[agent 0, ranks 0-1] fake agent 0/2 of {job}" in r.out \
            and f"[agent 1, ranks 2-3] fake agent 1/2 of {job}" in r.out
        r = cli("logs", job, "--json", "--state-dir", str(sd))
        assert r.code == 0 and len(r.json()["logs"]) == 2 and r.json()["unreachable"] == {}
    # a CLI talking straight to the scheduler over TCP (node a's identity is allowed there) sees them too
    r = cli("logs", job, "--endpoint", a.info()["scheduler_tcp"], "--server-key", str(a.state_dir / "keys" / "id.key"),
            "--state-dir", str(a.state_dir))
    assert r.code == 0 and "[agent 0, ranks 0-1] fake agent" in r.out and "[agent 1, ranks 2-3] fake agent" in r.out, r.err


def test_daemon_killed_takes_its_agents_along_and_restarts_with_the_job_table(cluster, tmp_path):
    d = cluster.daemon(cpu=2)
    sd = d.state_dir
    done = submit_fake(sd, "--workers", "1")
    wait_state(sd, done, "finished")
    hung = submit_fake(sd, "--workers", "2", "--min-devices", "2", FAKE_MODE="hang")
    info = wait_state(sd, hung, "running")
    pids = [a["pid"] for a in wait_until(lambda: len(status(sd, hung)["jobs"][0]["agents"]) == 2
                                         and status(sd, hung)["jobs"][0]["agents"], 10)]
    assert len(pids) == 2 and info["devices"] == 2
    d.kill()   # SIGKILL: no cleanup at all; the kernel's parent-death signal stops the agents

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True
    wait_until(lambda: all(gone(pid) for pid in pids), 20, what="orphaned agents to die")
    d.start()
    wait_until(lambda: status(sd)["nodes"], 90, what="restarted daemon to rejoin its embedded scheduler")
    jobs = {j["job_id"]: j for j in status(sd)["jobs"]}
    assert jobs[done]["state"] == "finished"
    # The job's agents went with the daemon: not the job's fault, so it restarts from its newest snapshot
    # (elasticd.scheduler.recovery) on the devices the restarted node offers again.
    info = wait_state(sd, hung, "running", timeout=30)
    assert any(h[1] == "recovering" and "vanished" in h[2] for h in info["history"]), info["history"]
    assert cli("stop", hung, "--state-dir", str(sd)).code == 0
    wait_until(lambda: status(sd)["nodes"][0]["free"] == ["cpu:0", "cpu:1"], 30, what="the devices to be free")
