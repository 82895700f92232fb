"""The island's events, for `elasticd events`: read off the job table, plus a small log of node events.

Jobs already record what happened to them (`history` [time, state, reason], `resizes`, `recoveries`), and
those records persist with the job: deriving the events from them keeps one source of truth, and a
restarted scheduler still tells a job's whole story. Nodes have no table row, so their joins, losses and
drains go into `NodeEvents`, a bounded in-memory log (the newest `MAX_NODE_EVENTS`; lost on a restart,
which the README says).

Every event is an `Event` record (elasticd.protocol.events): ``at`` (Unix time), ``event`` (a name from
`JOB_EVENTS` or `NODE_EVENTS`), ``job`` or ``node``, ``detail`` (one line for people), and, for some, the
figures of what happened (``from``/``to`` of a resize). Pure functions and a plain class: no sockets, no
clock.
"""

from __future__ import annotations

from collections import deque

from elasticd.core.lifecycle import TOOK_EFFECT, ResizeOutcome
from elasticd.protocol.events import Event
from elasticd.scheduler.jobs import Job

MAX_NODE_EVENTS = 1000
MAX_EVENTS_PER_REPLY = 2000   # one reply stays far below a frame's limit; the client pages on `at`

JOB_EVENTS = ("submitted", "placed", "started", "running", "requeued", "restarting", "resizing", "resized",
              "resize_aborted", "resize_failed", "resize_not_applied", "resize_refused", "rolled_back",
              "recovering", "recovered", "finished", "failed", "stopped")
NODE_EVENTS = ("node_joined", "node_rejoined", "node_lost", "node_left", "node_draining", "node_drained",
               "node_undrained")


def _state_event(state: str, reason: str, seen: set[str]) -> str:
    """Name a lifecycle entry: the first `starting` is the placement, the first `running` the start."""
    if state == "queued":
        return "submitted" if reason == "submitted" else "requeued"
    if state == "starting":
        return "placed" if "placed" not in seen else "restarting"
    if state == "running":
        return "started" if "started" not in seen else "running"
    return state


def job_events(job: Job) -> list[Event]:
    """Everything the table says happened to `job`, oldest first."""
    out: list[Event] = []
    seen: set[str] = set()
    for at, state, reason in job.history:
        name = _state_event(str(state), str(reason), seen)
        seen.add(name)
        out.append(Event(at=at, event=name, job=job.job_id, detail=str(reason)))
    for r in job.resizes:
        if r.outcome == ResizeOutcome.RESTARTING:
            continue   # a torchrun-mode restart in flight: the state entries tell it until it ends
        # A torchrun-mode job resized by a restart at the new size is resized all the same.
        name = "resized" if r.outcome in TOOK_EFFECT else "resize_" + r.outcome.replace(" ", "_")
        if r.outcome == ResizeOutcome.ROLLED_BACK:
            name = "rolled_back"
        took = r.seconds
        out.append(Event(
            at=round(r.at + (took or 0.0), 3), event=name, job=job.job_id, src=r.src, dst=r.dst, step=r.step,
            seconds=took,
            detail=f"{r.src} -> {r.dst} devices ({r.why})" + (f" in {took:.2f}s" if took is not None else "")
                   + (", restarting the torchrun-mode job" if r.outcome == ResizeOutcome.RESTARTED else "")
                   + (f": {r.note}" if r.note else "")))
    for c in job.recoveries:
        out.append(Event(at=round(c.at + (c.seconds or 0.0), 3), event="recovered", job=job.job_id,
                         seconds=c.seconds, steps_redone=c.steps_redone, detected_after=c.detected_after,
                         detail=f"{c.cause}: resumed at step {c.resumed_from} ({c.steps_redone} redone) "
                                f"on {c.devices} devices"))
    out.sort(key=lambda e: e.at)   # stable: a state entry stays before a resize recorded at its time
    return out


class EventLog:
    """The newest `limit` events of things with no persisted row to derive them from, each named in the
    event's field `subject` ("node", "island")."""

    def __init__(self, names: tuple[str, ...], subject: str, limit: int = MAX_NODE_EVENTS) -> None:
        self.names, self.subject = names, subject
        self._log: deque[Event] = deque(maxlen=limit)

    def add(self, now: float, event: str, who: str, detail: str = "") -> None:
        assert event in self.names, event
        self._log.append(Event(at=round(now, 3), event=event, detail=detail, **{self.subject: who}))

    def since(self, after: float) -> list[Event]:
        return [e for e in self._log if e.at > after]


class NodeEvents(EventLog):
    """The newest `MAX_NODE_EVENTS` node events."""

    def __init__(self, limit: int = MAX_NODE_EVENTS) -> None:
        super().__init__(NODE_EVENTS, "node", limit)


def select(jobs: list[Job], nodes: NodeEvents | None, after: float = 0.0,
           limit: int = MAX_EVENTS_PER_REPLY) -> tuple[list[Event], bool]:
    """The events later than `after` of `jobs` (and of the nodes, unless None), oldest first, at most
    `limit`; and whether more were left out (the caller asks again from the last one's time).

    A page ends only between two different times, so asking again with ``after`` = its last time
    neither repeats nor skips an event.
    """
    evs = [e for job in jobs for e in job_events(job) if e.at > after]
    if nodes is not None:
        evs += nodes.since(after)
    return page(evs, limit)


def page(evs: list[Event], limit: int = MAX_EVENTS_PER_REPLY) -> tuple[list[Event], bool]:
    """`evs` oldest first, at most `limit` (ending between two different times), and whether more were left out."""
    evs.sort(key=lambda e: e.at)
    if len(evs) <= limit:
        return evs, False
    cut = limit
    while cut > 0 and evs[cut - 1].at == evs[cut].at:
        cut -= 1
    if cut == 0:   # more than `limit` events at one instant: send them all rather than stall
        cut = limit
        while cut < len(evs) and evs[cut].at == evs[limit - 1].at:
            cut += 1
    return evs[:cut], True
