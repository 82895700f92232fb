"""`elasticd events`: the island's events from the job table and the scheduler's node log.

The pure part (naming history entries, paging) is tested on plain `Job`s; the rest against a real daemon
with its embedded scheduler and fake agents (tests/jobs/fake_agent.py), driven through the CLI.
"""

from __future__ import annotations

import json
import subprocess
import sys

from cluster import REPO, wait_state
from util import JOBS, cli, wait_until

from elasticd import keys
from elasticd import protocol as p
from elasticd.core.records import Recovery, ResizeEntry
from elasticd.scheduler import authz
from elasticd.scheduler.events import NodeEvents, job_events, select
from elasticd.scheduler.jobs import Job, JobSpec, JobState
from elasticd.scheduler.state import SchedulerState

FAKE_SCRIPT = str(JOBS / "fake_agent.py")


def _job(job_id: str, owner: str = "") -> Job:
    spec = JobSpec(script="/x.py", func=None, workers=2, min_devices=1, max_devices=2, owner=owner)
    return Job(job_id=job_id, seq=int(job_id[1:]), spec=spec, history=[[1.0, "queued", "submitted"]])


def test_history_resizes_and_recoveries_become_named_events_in_time_order():
    job = _job("j1")
    job.transition(JobState.STARTING, 2.0, "placed on n1")
    job.transition(JobState.RUNNING, 3.0, "agents up")
    job.transition(JobState.RECOVERING, 5.0, "agent killed")
    job.transition(JobState.STARTING, 5.5, "restart from snapshot")
    job.transition(JobState.RUNNING, 6.0, "agents up")
    job.transition(JobState.FINISHED, 9.0, "done")
    job.resizes.append(ResizeEntry(at=3.5, src=2, dst=1, why="scale command", step=7, outcome="done", seconds=0.5))
    job.resizes.append(ResizeEntry(at=4.0, src=1, dst=2, why="policy", outcome="rolled back", seconds=0.1))
    job.recoveries.append(Recovery(at=5.0, cause="agent_killed", failed_after_step=6, from_devices=2, devices=1,
                                   resumed_from=4, steps_redone=3, seconds=1.25))
    got = [(e.at, e.event) for e in job_events(job)]
    assert got == [(1.0, "submitted"), (2.0, "placed"), (3.0, "started"), (4.0, "resized"), (4.1, "rolled_back"),
                   (5.0, "recovering"), (5.5, "restarting"), (6.0, "running"), (6.25, "recovered"),
                   (9.0, "finished")]
    resized = job_events(job)[3]
    assert resized.src == 2 and resized.dst == 1 and "scale command" in resized.detail


def test_pages_end_between_two_times_so_asking_again_from_the_last_neither_repeats_nor_skips():
    nodes = NodeEvents(limit=5)
    for i in range(8):   # bounded: only the newest 5 are kept
        nodes.add(float(i // 2), "node_joined", f"n{i}")
    assert [e.node for e in nodes.since(0.0)] == ["n3", "n4", "n5", "n6", "n7"]
    seen: list[str] = []
    after, more = -1.0, True
    while more:
        page, more = select([], nodes, after, limit=2)
        assert page, "a page must make progress"
        seen += [e.node for e in page]
        after = page[-1].at
    assert seen == ["n3", "n4", "n5", "n6", "n7"]


def test_a_client_sees_its_own_jobs_events_an_admin_every_job():
    state = SchedulerState([_job("j1", owner="KEYA"), _job("j2", owner="KEYB")], now=0.0)
    mine = state.events(None, 0.0, owner="KEYA").events
    assert {e.job for e in mine if e.job is not None} == {"j1"}
    assert {e.job for e in state.events(None, 0.0).events} == {"j1", "j2"}
    client = authz.Principal(owner="KEYA", role=keys.CLIENT)
    assert authz.check(client, p.Events(job_id="j2"), "KEYB") is not None
    assert authz.check(client, p.Events(job_id="j1"), "KEYA") is None
    assert not authz.sees_all_jobs(client) and authz.sees_all_jobs(authz.LOCAL)


def test_events_follow_a_job_through_a_resize_to_its_end(cluster):
    d = cluster.daemon(cpu=2)
    assert d.info()["metrics"] is None   # no HTTP endpoint unless asked for (`--metrics`)
    sd = str(d.state_dir)
    r = cli("submit", FAKE_SCRIPT, "--workers", "2", "--env", "FAKE_MODE=hang", "--state-dir", sd)
    assert r.code == 0, r.err
    job = r.out.strip()
    wait_state(d.state_dir, job, "running")
    follow = subprocess.Popen([sys.executable, "-m", "elasticd", "events", job, "-f", "--json", "--state-dir", sd],
                              cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        assert cli("scale", job, "--devices", "1", "--state-dir", sd).code == 0
        wait_until(lambda: "resized" in [e["event"] for e in _events(sd, job)], 30, what="the resize event")
        assert cli("stop", job, "--state-dir", sd).code == 0
        out, err = follow.communicate(timeout=30)   # -f on a job returns once the job has ended
    finally:
        follow.kill()
    assert follow.returncode == 0, err
    streamed = [json.loads(line) for line in out.splitlines()]
    names = [e["event"] for e in streamed]
    assert names[:3] == ["submitted", "placed", "started"] and names[-1] == "stopped", names
    assert "resized" in names and names.index("resized") < names.index("stopped")
    assert all(e["job"] == job and isinstance(e["at"], float) for e in streamed)
    assert [e["at"] for e in streamed] == sorted(e["at"] for e in streamed)
    assert streamed == _events(sd, job)   # following printed exactly what a later read prints

    island = _events(sd)
    assert any(e["event"] == "node_joined" and e.get("node") for e in island)
    text = cli("events", "--state-dir", sd)
    assert text.code == 0 and f"job {job}" in text.out and "resized" in text.out and "2 -> 1 devices" in text.out

    bad = cli("events", "j404", "--json", "--state-dir", sd)
    assert bad.code == 1 and json.loads(bad.out)["code"] == "unknown_job"


def _events(sd: str, job: str | None = None) -> list[dict]:
    r = cli("events", *([job] if job else []), "--json", "--state-dir", sd)
    assert r.code == 0, r.err
    return [json.loads(line) for line in r.out.splitlines()]
