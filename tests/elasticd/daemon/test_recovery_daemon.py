"""Recovery through a real node daemon (embedded scheduler): an agent killed with SIGKILL is not the job's
failure. The job goes `recovering`, restarts from its newest periodic snapshot, and finishes bitwise equal
(deterministic mode) to a run nobody disturbed, every step and sample kept exactly once; `status` records
the recovery. Real agents run tests/jobs/resize_job.py, paced until the test releases it."""

from __future__ import annotations

import dataclasses
import os
import signal
from pathlib import Path

import pytest
from cluster import status, wait_state
from daemon_jobs import job_env, job_info, submit
from util import JOBS, assert_same_run, cli, completed_twice, consumed, wait_until

from elasticd.core.records import Recovery

JOB = str(JOBS / "resize_job.py")
STEPS = 60


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("undisturbed")
    (out / "release").touch()
    r = cli("run", JOB, "--devices", "2", "--snapshot-every", "0", env=job_env(out, steps=STEPS), timeout=600)
    assert r.code == 0, r.err[-3000:]
    return out


def _training_with_a_snapshot(submit_dir: Path, watch_dir: Path, tmp_path: Path, *args: str) -> tuple[str, Path, dict]:
    """A paced deterministic job (4 workers, up to 2 devices, a snapshot every 5 steps) once it is past step
    12 with the snapshot of step 10 complete: (job id, its output folder, its status)."""
    out = tmp_path / "run"
    out.mkdir()
    job = submit(submit_dir, JOB, job_env(out, steps=STEPS), "--workers", "4", "--max-devices", "2",
                 "--snapshot-every", "5", *args)
    wait_state(watch_dir, job, "running", timeout=120)
    info = wait_until(lambda: (i := job_info(watch_dir, job))["step"] >= 12
                      and (i.get("snapshot") or {}).get("step", -1) >= 10 and i,
                      300, interval=0.1, what="step 12 and the snapshot of step 10")
    return job, out, info


def test_an_agent_killed_under_the_daemon_is_recovered_from_the_snapshot(cluster, tmp_path, undisturbed):
    d = cluster.daemon(cpu=2, fake=False)
    sd = d.state_dir
    job, out, info = _training_with_a_snapshot(sd, sd, tmp_path)
    victim = next(a for a in info["agents"] if a["rank"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    wait_until(lambda: job_info(sd, job)["recoveries"], 180, interval=0.1, what="the recovery")
    (out / "release").touch()
    info = wait_state(sd, job, "finished", timeout=300)
    [rec] = info["recoveries"]
    assert "killed by SIGKILL" in rec["cause"], rec
    assert rec["resumed_from"] >= 10 and rec["resumed_from"] % 5 == 0, rec
    assert rec["steps_redone"] == rec["failed_after_step"] + 1 - rec["resumed_from"], rec
    assert completed_twice(out) == list(range(rec["resumed_from"], rec["failed_after_step"] + 1)), rec
    assert rec["devices"] == 2 and rec["seconds"] > 0
    assert set(rec) == {f.name for f in dataclasses.fields(Recovery)}   # `elasticd run`'s record, field for field
    assert any(h[1] == "recovering" for h in info["history"])
    assert_same_run(out, undisturbed, STEPS, ranks=4, recovered=True)
    for epoch in range(STEPS // 10):
        idx = sorted(i for r in range(4) for s, b in consumed(out, r, kept=True) if s // 10 == epoch for i in b)
        assert idx == list(range(400)), f"epoch {epoch} lost or repeated samples"
    shown = cli("status", job, "--state-dir", str(sd))
    assert "recoveries 1" in shown.out and "killed by SIGKILL" in shown.out, shown.out


def test_a_stopped_agent_under_the_daemon_is_fenced_and_the_job_recovers_bitwise(cluster, tmp_path, undisturbed):
    """SIGSTOP, never continued: the node's watchdog (elasticd/core/watchdog.py) kills the agent after
    --stuck-after, and the scheduler recovers the job as from a killed agent, naming why."""
    d = cluster.daemon(cpu=2, fake=False)
    sd = d.state_dir
    job, out, info = _training_with_a_snapshot(sd, sd, tmp_path, "--stuck-after", "2")
    victim = next(a for a in info["agents"] if a["rank"] == 1)
    os.kill(victim["pid"], signal.SIGSTOP)
    try:
        wait_until(lambda: job_info(sd, job)["recoveries"], 180, interval=0.1, what="the recovery")
    finally:
        try:
            os.kill(victim["pid"], signal.SIGKILL)   # the watchdog's job; if it failed, the test must not leave it
        except ProcessLookupError:
            pass
    (out / "release").touch()
    info = wait_state(sd, job, "finished", timeout=300)
    [rec] = info["recoveries"]
    # Stopped for 2 s, or stopped and waited for by agent 0 for 2 s, whichever the watchdog saw first.
    assert rec["cause"].startswith("agent 1 was stuck (stopped") and "--stuck-after 2s) and was fenced" \
        in rec["cause"], rec
    assert rec["steps_redone"] == rec["failed_after_step"] + 1 - rec["resumed_from"], rec
    assert completed_twice(out) == list(range(rec["resumed_from"], rec["failed_after_step"] + 1)), rec
    # Held longer than the bound before it was fenced (`seconds` counts from there); kept to the millisecond.
    assert rec["detected_after"] >= 2.0, rec
    assert_same_run(out, undisturbed, STEPS, ranks=4, recovered=True)
    events = cli("events", job, "--state-dir", str(sd))
    assert "was stuck (stopped" in events.out, events.output


def test_a_worker_exception_under_the_daemon_is_not_retried(cluster, tmp_path):
    d = cluster.daemon(cpu=2, fake=False)
    job = submit(d.state_dir, str(JOBS / "raises.py"), {}, "--max-devices", "2", "--snapshot-every", "1")
    info = wait_state(d.state_dir, job, "failed", timeout=180)
    assert info["recoveries"] == [] and "DeliberateFailure" in info["error"]["message"]
    assert not any(h[1] == "recovering" for h in info["history"])


@pytest.mark.slow
def test_a_lost_node_and_its_agents_the_job_goes_on_from_the_snapshot_copy_on_the_other_node(
        cluster, tmp_path, undisturbed):
    """Two daemons under a standalone scheduler, one agent each; node b is SIGKILLed with its agents. Its parts
    of the snapshot were copied to node a (the buddy), so the job resumes there, on one device, at the step
    of its newest snapshot, and ends as if nothing happened."""
    sched = cluster.scheduler()
    nodes = [cluster.node(sched, name, fake=False, own_forks=True) for name in ("a", "b")]   # kills b's agents
    sd = sched.state_dir
    wait_until(lambda: len(status(sd)["nodes"]) == 2, 90, what="both nodes to join")
    job, out, _ = _training_with_a_snapshot(nodes[0].state_dir, sd, tmp_path, "--min-devices", "1")
    b_id = nodes[1].info()["node_id"]
    for agent in nodes[1].agents():
        agent.kill()
    nodes[1].kill()
    info = wait_until(lambda: (i := job_info(sd, job))["recoveries"] and i, 180, interval=0.1,
                      what="the recovery")
    (out / "release").touch()
    info = wait_state(sd, job, "finished", timeout=300)
    [rec] = info["recoveries"]
    assert rec["devices"] == 1 and rec["from_devices"] == 2, rec
    assert rec["resumed_from"] >= 10, f"the lost node's parts were not on the other node: {rec}"
    assert b_id not in info["nodes"]
    assert_same_run(out, undisturbed, STEPS, ranks=4, recovered=True)


@pytest.mark.slow
def test_a_daemon_killed_and_restarted_resumes_its_job_from_the_snapshot_it_kept(cluster, tmp_path, undisturbed):
    """The node daemon (with its embedded scheduler) is SIGKILLed: its agents stop with it (they never train
    on unsupervised). Restarted on the same state dir, the scheduler finds the job running in its table and
    no agents on the node, and restarts it from the periodic snapshot the node kept in tmpfs."""
    d = cluster.daemon(cpu=2, fake=False, own_forks=True)   # looks at its agents
    sd = d.state_dir
    job, out, _ = _training_with_a_snapshot(sd, sd, tmp_path)
    agents = d.agents()
    d.kill()
    wait_until(lambda: not any(a.is_running() and a.status() != "zombie" for a in agents), 30,
               what="the agents to stop with their daemon")
    d.start()
    wait_until(lambda: job_info(sd, job)["recoveries"], 180, interval=0.1, what="the recovery")
    (out / "release").touch()
    info = wait_state(sd, job, "finished", timeout=300)
    [rec] = info["recoveries"]
    assert rec["resumed_from"] >= 10, f"the snapshot did not survive the daemon's restart: {rec}"
    assert_same_run(out, undisturbed, STEPS, ranks=4, recovered=True)
