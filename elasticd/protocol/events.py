"""`elasticd events`: ask for the island's events after a time, and the reply (elasticd.scheduler.events)."""

from __future__ import annotations

import math
from typing import Any, ClassVar

from elasticd.protocol import limits as L
from elasticd.protocol.wire import Message, message


@message
class Events(Message):
    """The events later than `after` (Unix time; 0: all kept), of one job or of the whole island.

    A client key sees the events of its own jobs (and the nodes'); an admin or the local user sees all.
    """

    op: ClassVar[str] = "events"
    job_id: str | None = None
    after: float = 0.0

    def check(self) -> str | None:
        if not math.isfinite(self.after) or self.after < 0:
            return f"after must be a finite time >= 0, got {self.after}"
        return None if self.job_id is None else L.bad_text("job id", self.job_id, L.MAX_JOB_ID)


@message
class EventsReply(Message):
    op: ClassVar[str] = "events_reply"
    events: list[dict[str, Any]]
    more: bool = False    # a page: ask again with after = the last event's `at`
