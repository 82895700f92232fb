"""The front's table of jobs spanning islands on disk: one SQLite row per job (`Span.to_doc`, JSON we wrote
ourselves; never pickled), opened as an island's job table is (elasticd/scheduler/store.py), and written
through after every change, so a front restarted or killed at any point goes on with its jobs."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from elasticd.federation.spans import Span
from elasticd.scheduler.store import open_table

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1


class SpanStore:
    """Raises (opening): elasticd.scheduler.store.StoreError."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._db = open_table(self.path, SCHEMA_VERSION)
        self.saved: set[str] = set()

    def load(self) -> list[dict[str, Any]]:
        docs = []
        for span_id, doc in self._db.execute("SELECT job_id, doc FROM jobs ORDER BY seq"):
            try:
                docs.append(json.loads(doc))
            except ValueError as e:   # a row we cannot read must not keep the front down
                log.error("skipping unreadable job row %s in %s: %s", span_id, self.path, e)
                continue
            self.saved.add(span_id)
        return docs

    def sync(self, spans: dict[str, Span]) -> None:
        """Write the jobs that changed, and drop those the table no longer keeps."""
        rows = [(s.span_id, s.seq, s.state, json.dumps(s.to_doc(), separators=(",", ":")))
                for s in spans.values() if s.changed]
        gone = [(i,) for i in self.saved - spans.keys()]
        if not rows and not gone:
            return
        with self._db:
            self._db.execute("BEGIN")
            self._db.executemany("INSERT OR REPLACE INTO jobs VALUES (?, ?, ?, ?)", rows)
            self._db.executemany("DELETE FROM jobs WHERE job_id = ?", gone)
        for s in spans.values():
            s.changed = False
        self.saved = set(spans)

    def close(self) -> None:
        self._db.close()
