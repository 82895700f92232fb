"""`elasticd events`: ask for the island's events after a time, and the reply (elasticd.scheduler.events)."""

from __future__ import annotations

import math
from dataclasses import field
from typing import ClassVar

from elasticd.core.records import WIRE_FROM, WIRE_TO
from elasticd.protocol import limits as L
from elasticd.protocol.wire import Message, message, record


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


@record
class Event:
    """One thing that happened: to a job (`job`) or to a node (`node`); the figures only where they apply."""

    at: float                     # Unix time
    event: str                    # a name from elasticd.scheduler.events JOB_EVENTS or NODE_EVENTS
    detail: str                   # one line for people
    job: str | None = None
    node: str | None = None
    island: str | None = None     # at a federation front: an island joined, lost, back or left
    src: int | None = field(default=None, metadata=WIRE_FROM)   # a resize: devices before
    dst: int | None = field(default=None, metadata=WIRE_TO)     # and asked for
    step: int | None = None       # a resize: the last step before it
    seconds: float | None = None  # a resize or a recovery: how long it took
    steps_redone: int | None = None        # a recovery: steps computed again
    detected_after: float | None = None    # a recovery: seconds the job was held before the failure was seen


@message
class EventsReply(Message):
    op: ClassVar[str] = "events_reply"
    events: list[Event]
    more: bool = False    # a page: ask again with after = the last event's `at`
