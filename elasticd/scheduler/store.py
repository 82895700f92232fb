"""The job table on disk: one SQLite row per job, written through on every state change.

WAL mode with synchronous=NORMAL survives the scheduler process being killed at any point (only a
power loss can drop the last transactions), so a restarted scheduler resumes with the same table.
The row holds the job as JSON (data we wrote ourselves; never pickled).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from elasticd.core.errors import ControlPlaneError
from elasticd.scheduler.jobs import Job

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1


class StoreError(ControlPlaneError, RuntimeError):
    """The job table cannot be opened safely (a symlink in its place, another schema)."""


def open_table(path: Path, schema: int) -> sqlite3.Connection:
    """A job table's SQLite file (created owner-only), with its `meta` and `jobs` tables at `schema`.

    Raises:
        StoreError: a symlink in its place, or a table of another schema.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    for p in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        if p.is_symlink():   # sqlite would follow it and write the job table to its target
            raise StoreError(f"{p} is a symlink: refusing to open the job table through it")
    # Owner-only, whatever the umask: the table holds every job's environment. SQLite gives its -wal and
    # -shm files the database file's mode.
    os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600))
    os.chmod(path, 0o600)
    # The loop owns the connection; check_same_thread=False only lets the embedded scheduler thread open
    # it in __init__ and use it in run().
    db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
    db.execute("CREATE TABLE IF NOT EXISTS jobs (job_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, "
               "state TEXT NOT NULL, doc TEXT NOT NULL)")
    row = db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
    if row is None:
        db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(schema),))
    elif int(row[0]) != schema:
        db.close()
        raise StoreError(f"{path}: job table schema {row[0]}, this elasticd reads {schema}")
    return db


class JobStore:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._db = open_table(self.path, SCHEMA_VERSION)

    def load(self) -> list[Job]:
        jobs = []
        for job_id, doc in self._db.execute("SELECT job_id, doc FROM jobs ORDER BY seq"):
            try:
                jobs.append(Job.from_doc(json.loads(doc)))
            except Exception as e:  # a row we cannot read must not keep the scheduler down
                log.error("skipping unreadable job row %s in %s: %s", job_id, self.path, e)
        return jobs

    def save(self, jobs: Iterable[Job]) -> None:
        rows = [(j.job_id, j.seq, j.state.value, json.dumps(j.to_doc(), separators=(",", ":")))
                for j in jobs]
        if not rows:
            return
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany("INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?)", rows)

    def delete(self, job_ids: Iterable[str], next_seq: int) -> None:
        """Remove purged jobs; `next_seq` is kept so that their ids are never handed out again."""
        ids = [(j,) for j in job_ids]
        if not ids:
            return
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany("DELETE FROM jobs WHERE job_id = ?", ids)
            self._db.execute("INSERT OR REPLACE INTO meta VALUES ('next_seq', ?)", (str(next_seq),))

    def load_speeds(self) -> dict[str, Any]:
        """The island's cost model and re-layout gate (elasticd.placement.speeds); {} if none was saved or
        the saved one cannot be read (the speeds are learned again: a bad row must not keep the scheduler down)."""
        row = self._db.execute("SELECT value FROM meta WHERE key='speeds'").fetchone()
        if row is None:
            return {}
        try:
            d = json.loads(row[0])
        except ValueError as e:
            log.error("ignoring unreadable device speeds in %s: %s", self.path, e)
            return {}
        return d if isinstance(d, dict) else {}

    def save_speeds(self, d: dict[str, Any]) -> None:
        self._db.execute("INSERT OR REPLACE INTO meta VALUES ('speeds', ?)", (json.dumps(d, separators=(",", ":")),))

    def next_seq(self) -> int:
        row = self._db.execute("SELECT value FROM meta WHERE key='next_seq'").fetchone()
        return int(row[0]) if row else 0

    def close(self) -> None:
        self._db.close()
