"""The job table stays bounded and `status` keeps working whatever it holds: a
table of 4000 jobs is listed in pages that each fit a frame, ended jobs are purged after
--job-retention (their ids never handed out again), and quotas cap queued jobs per key and in total."""

from __future__ import annotations

import os
import time
from pathlib import Path

from cluster import Cluster, status
from util import JOBS, cli, wait_until

from elasticd.daemon.processes import sweep_logs
from elasticd.scheduler.jobs import Job, JobSpec, JobState
from elasticd.scheduler.store import JobStore
from elasticd.statedir import StateDir

FAKE_SCRIPT = str(JOBS / "fake_agent.py")
N_JOBS = 4000


def fill(db: Path, n: int, ended_at: float) -> None:
    """A job table as months of use leave it: `n` failed jobs, each with a long path and a traceback."""
    store = JobStore(db)
    jobs = []
    for seq in range(1, n + 1):
        spec = JobSpec(script="/" + "p" * 1000 + f"/train{seq}.py", func=None, workers=8, min_devices=1,
                       max_devices=8, name=f"sweep-{seq}", owner="local")
        jobs.append(Job(job_id=f"j{seq}", seq=seq, spec=spec, state=JobState.FAILED, submitted_at=ended_at - 60,
                        ended_at=ended_at, history=[[ended_at, "failed", "boom"]],
                        error={"message": "boom", "traceback": "Traceback\n" + "  frame\n" * 30}))
    store.save(jobs)
    store.close()


def start_scheduler(cluster: Cluster, name: str, *extra: str):
    proc = cluster.scheduler(name)
    if extra:   # restart it with the options under test on the same state dir
        proc.cleanup()
        proc.argv += list(extra)
        proc.start()
    return proc


def test_status_lists_4000_jobs_in_pages(cluster, tmp_path):
    sd = tmp_path / "big"
    sd.mkdir(mode=0o700)
    fill(sd / "scheduler.db", N_JOBS, ended_at=time.time())
    sched = start_scheduler(cluster, "big")
    t0 = time.monotonic()
    r = cli("status", "--json", "--state-dir", str(sd), "--timeout", "30")
    took = time.monotonic() - t0
    assert r.code == 0, r.err[-2000:]
    ids = [j["job_id"] for j in r.json()["jobs"]]
    assert ids == [f"j{i}" for i in range(1, N_JOBS + 1)]
    r = cli("status", "--state-dir", str(sd), "--timeout", "30")
    assert r.code == 0 and f"sweep-{N_JOBS}" in r.out
    print(f"status --json of {N_JOBS} jobs: {took:.2f}s")
    assert sched.popen.poll() is None


def test_ended_jobs_are_purged_after_the_retention_and_their_ids_not_reused(cluster, tmp_path):
    sd = tmp_path / "old"
    sd.mkdir(mode=0o700)
    fill(sd / "scheduler.db", 50, ended_at=time.time() - 7200)   # ended two hours ago
    start_scheduler(cluster, "old", "--job-retention", "3600")
    wait_until(lambda: status(sd)["jobs"] == [], 20, what="the 50 expired jobs to be purged")
    r = cli("submit", FAKE_SCRIPT, "--workers", "1", "--state-dir", str(sd))
    assert r.code == 0 and r.out.strip() == "j51", (r.out, r.err)   # j1..j50 are never handed out again


def test_quota_per_owner(cluster, tmp_path):
    sd = tmp_path / "quota"
    sd.mkdir(mode=0o700)
    start_scheduler(cluster, "quota", "--max-jobs-per-owner", "2")
    for _ in range(2):   # no node yet: the jobs wait in the queue
        assert cli("submit", FAKE_SCRIPT, "--workers", "1", "--state-dir", str(sd)).code == 0
    r = cli("submit", FAKE_SCRIPT, "--workers", "1", "--state-dir", str(sd))
    assert r.code == 1 and "[quota]" in r.err and "--max-jobs-per-owner 2" in r.err, r.err
    first = status(sd)["jobs"][0]["job_id"]
    assert cli("stop", first, "--state-dir", str(sd)).code == 0     # an ended job frees its slot
    assert cli("submit", FAKE_SCRIPT, "--workers", "1", "--state-dir", str(sd)).code == 0


def test_an_ended_job_s_env_does_not_stay_in_the_job_table(cluster, tmp_path):
    sd = tmp_path / "env"
    sd.mkdir(mode=0o700)
    start_scheduler(cluster, "env")
    job = cli("submit", FAKE_SCRIPT, "--workers", "1", "--env", "API_TOKEN=s3cret-value", "--state-dir", str(sd))
    assert job.code == 0, job.err
    job = job.out.strip()
    assert b"s3cret-value" in (sd / "scheduler.db").read_bytes() + _wal(sd)   # queued: kept until it runs
    assert cli("stop", job, "--state-dir", str(sd)).code == 0

    def scrubbed() -> bool:
        store = JobStore(sd / "scheduler.db")
        try:
            return [j.spec.env for j in store.load() if j.job_id == job] == [{}]
        finally:
            store.close()
    wait_until(scrubbed, 20, what="the stopped job's env to be dropped from the table")


def _wal(sd: Path) -> bytes:
    wal = sd / "scheduler.db-wal"
    return wal.read_bytes() if wal.exists() else b""


def test_a_purged_jobs_logs_go_after_the_retention_and_a_running_jobs_stay(tmp_path):
    """A node deletes the output of jobs that ended longer than --job-retention ago (the scheduler has purged
    them: nobody may read it any more), never that of a job still running here, however old its files. (Error
    reports live in the job's directory of the agents' area, which goes when the scheduler forgets the job.)"""
    sd = StateDir(tmp_path / "node")
    now = time.time()
    for job, age in (("j1", 8 * 86400), ("j2", 3600), ("j3", 8 * 86400)):
        for kind in ("logs",):
            folder = sd.root / kind / job
            folder.mkdir(parents=True)
            (folder / "rank0.log").write_text("output\n")
            for path in (folder / "rank0.log", folder):
                os.utime(path, (now - age, now - age))
    gone = sweep_logs(sd, now, 7 * 86400, live={"j3"})
    assert gone == ["logs/j1"]
    assert sorted(p.name for p in (sd.root / "logs").iterdir()) == ["j2", "j3"]
