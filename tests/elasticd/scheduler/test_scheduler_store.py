"""The SQLite job table: what a scheduler writes, a new scheduler process reads back."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
import sys

from island_core import Island, rep

from elasticd import protocol as p
from elasticd.core.records import Recovery, ResizeEntry
from elasticd.scheduler.jobs import Job, JobState, RecoveryInFlight
from elasticd.scheduler.state import SchedulerState
from elasticd.scheduler.store import JobStore


def test_round_trip_through_sqlite(tmp_path):
    store = JobStore(tmp_path / "jobs.db")
    s = SchedulerState(store.load(), now=0.0)
    job, _ = s.submit(p.Submit(script="/x.py", workers=4, min_devices=2, max_devices=4, priority=3, name="n",
                               env={"K": "V"}), 0.0)
    s.stop(job.job_id, 1.0)
    store.save(s.take_dirty())
    assert s.take_dirty() == []
    store.close()
    back = JobStore(tmp_path / "jobs.db").load()
    assert [j.to_doc() for j in back] == [job.to_doc()]
    assert back[0].state is JobState.STOPPED and back[0].spec.env == {"K": "V"}


def test_table_written_by_a_killed_process_survives(tmp_path):
    db = tmp_path / "jobs.db"
    code = (
        "import os, sys\n"
        "from elasticd import protocol as p\n"
        "from elasticd.scheduler.state import SchedulerState\n"
        "from elasticd.scheduler.store import JobStore\n"
        f"st = JobStore({str(db)!r}); s = SchedulerState(now=0.0)\n"
        "for i in range(3):\n"
        "    s.submit(p.Submit(script='/x.py', workers=2), 0.0)\n"
        "    st.save(s.take_dirty())\n"
        "os.kill(os.getpid(), 9)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert r.returncode == -9
    jobs = JobStore(db).load()
    assert [j.job_id for j in jobs] == ["j1", "j2", "j3"]


def test_unreadable_row_is_skipped_not_fatal(tmp_path):
    store = JobStore(tmp_path / "jobs.db")
    s = SchedulerState(now=0.0)
    s.submit(p.Submit(script="/x.py", workers=2), 0.0)
    store.save(s.take_dirty())
    with sqlite3.connect(tmp_path / "jobs.db") as db:
        db.execute("INSERT INTO jobs VALUES ('bad', 99, 'queued', '{not json')")
    assert [j.job_id for j in store.load()] == ["j1"]


def test_a_resize_in_flight_reads_back_with_its_phase(tmp_path):
    from elasticd.core.lifecycle import ResizePhase
    from elasticd.resize_plan import ResizePlan

    store = JobStore(tmp_path / "jobs.db")
    s = SchedulerState([], now=0.0)
    job, _ = s.submit(p.Submit(script="/x.py", workers=4, min_devices=1, max_devices=4), 0.0)
    job.resize = ResizePlan.begin(epoch=1, src=1, dst=2, why="test", now=0.0, placement=[["a", "cpu:0"], ["a", "cpu:1"]],
                                  step=3, timeout_s=60.0)
    job.resize.phase = ResizePhase.GO
    store.save([job])
    store.close()
    [back] = JobStore(tmp_path / "jobs.db").load()
    assert back.resize is not None and back.resize.phase is ResizePhase.GO
    assert back.to_doc() == job.to_doc()


def test_the_job_table_is_the_owners_alone_whatever_the_umask(tmp_path):
    """It holds every job's --env (secrets included): 0600, its WAL and shared-memory files too."""
    old = os.umask(0o022)
    try:
        store = JobStore(tmp_path / "scheduler.db")
        s = SchedulerState(store.load(), now=0.0)
        s.submit(p.Submit(script="/x.py", workers=2, env={"TOKEN": "secret"}), 0.0)
        store.save(s.take_dirty())
        files = [f for f in tmp_path.iterdir() if f.name.startswith("scheduler.db")]
        modes = {f.name: oct(stat.S_IMODE(f.stat().st_mode)) for f in files}
        store.close()
    finally:
        os.umask(old)
    assert len(files) == 3 and set(modes.values()) == {"0o600"}, modes


def test_a_recovery_in_flight_is_read_back_typed_from_either_form(tmp_path):
    """A job recovering when its scheduler stopped restarts from the record it kept: the typed record, and the
    same record as one flat map."""
    isl = Island()
    isl.hello("a", 2)
    job, _ = isl.submit(workers=2, lo=1, hi=2)
    isl.report("a", rep(job, "running", (0, 1), step=7))
    isl.report("a", rep(job, "ended", (0, 1), ok=False, error={"message": "agent 1 was killed by SIGKILL",
                                                               "cause": "died", "exitcode": -9}))
    j = isl.s.jobs[job]
    assert j.state is JobState.STARTING and j.recovery is not None
    store = JobStore(tmp_path / "jobs.db")
    store.save([j])
    store.close()
    [back] = JobStore(tmp_path / "jobs.db").load()
    assert isinstance(back.recovery, RecoveryInFlight) and isinstance(back.recovery.record, Recovery)
    assert back.to_doc() == j.to_doc() and back.recovery.kind == "died" and back.recovery.gone == ["a"]
    rec = j.recovery
    flat = {**rec.record.to_dict(), "kind": rec.kind, "gone": rec.gone, "error": rec.error}
    assert Job.from_doc({**j.to_doc(), "recovery": flat}).recovery == rec


def test_a_row_s_history_and_agents_read_back_typed_and_a_key_of_another_version_loses_nothing(tmp_path):
    """The resize and recovery histories come back as the records they were (the row keeps a resize's "from"
    and "to"); a key this version does not know in them is left out, and agents' reports of another shape
    are dropped (the next heartbeats bring them), instead of the whole job being skipped as unreadable."""
    isl = Island()
    isl.hello("a", 2)
    job, _ = isl.submit(workers=2, lo=1, hi=2)
    isl.report("a", rep(job, "running", (0, 1), step=7, agents=[
        p.AgentReport(rank=0, device_id="cpu:0", pid=11, alive=True, connected=True)]))
    j = isl.s.jobs[job]
    j.resizes.append(ResizeEntry(src=2, dst=1, outcome="done", at=3.0, why="scale command", step=5))
    j.recoveries.append(Recovery(cause="agent 1 was killed", at=4.0, failed_after_step=6, from_devices=2, devices=2))
    doc = j.to_doc()
    assert doc["resizes"][0]["from"] == 2 and doc["resizes"][0]["to"] == 1 and "src" not in doc["resizes"][0]
    back = Job.from_doc(doc)
    assert back.resizes == j.resizes and back.recoveries == j.recoveries and back.agents == j.agents
    assert [type(a) for rows in back.agents.values() for a in rows] == [p.AgentRow]
    other = {**doc, "resizes": [{**doc["resizes"][0], "shard_mb": 3}],
             "recoveries": [{**doc["recoveries"][0], "zone": "b"}],
             "agents": {"a": [{"rank": 0, "pid": 11, "gpu_util": 0.5}]}}
    back = Job.from_doc(other)
    assert back.resizes == j.resizes and back.recoveries == j.recoveries and back.agents == {}


def test_a_grow_prepared_ahead_and_waiting_for_its_step_reads_back_waiting(tmp_path):
    """Warm and waiting for its step, it has no deadline (infinity, which the row's JSON keeps)."""
    from elasticd.resize_plan import Go, ResizePlan

    store = JobStore(tmp_path / "jobs.db")
    s = SchedulerState([], now=0.0)
    job, _ = s.submit(p.Submit(script="/x.py", workers=4, min_devices=1, max_devices=4), 0.0)
    job.resize = ResizePlan.begin(epoch=1, src=1, dst=2, why="--scale-at 9:2", now=0.0,
                                  placement=[["a", "cpu:0"], ["a", "cpu:1"]], step=3, timeout_s=60.0, after_step=9)
    job.prepared = 9
    assert job.resize.port_known(5, 1.0) == [] and job.resize.joiner_ready(1, 1.0) == []
    store.save([job])
    store.close()
    [back] = JobStore(tmp_path / "jobs.db").load()
    assert back.to_doc() == job.to_doc() and back.resize.ahead and back.resize.tick(1e9, ["a"]) == []
    assert back.resize.reached(9, 5.0) == [Go()]
