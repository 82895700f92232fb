"""A federation front's events, for `elasticd events` asked of the front: read off its jobs' histories
(elasticd/federation/spans.py), plus a small log of island events. Pure, like the scheduler's
(elasticd/scheduler/events.py), whose paging it shares."""

from __future__ import annotations

from collections import deque

from elasticd.protocol.events import Event
from elasticd.scheduler.events import MAX_NODE_EVENTS, page

ISLAND_EVENTS = ("island_joined", "island_lost", "island_back", "island_left")


class IslandEvents:
    """The newest island events (islands have no table row a restarted front would keep)."""

    def __init__(self, limit: int = MAX_NODE_EVENTS) -> None:
        self._log: deque[Event] = deque(maxlen=limit)

    def add(self, now: float, event: str, island: str, detail: str = "") -> None:
        assert event in ISLAND_EVENTS, event
        self._log.append(Event(at=round(now, 3), event=event, island=island, detail=detail))

    def since(self, after: float) -> list[Event]:
        return [e for e in self._log if e.at > after]


def span_events(span_id: str, history: list[tuple[float, str, str]]) -> list[Event]:
    """A job's history as events: its first entry is its submission, each other a state it went to."""
    return [Event(at=at, event="submitted" if k == 0 else state, job=span_id, detail=reason)
            for k, (at, state, reason) in enumerate(history)]


def select(spans: list[tuple[str, list[tuple[float, str, str]]]], islands: IslandEvents | None,
           after: float = 0.0) -> tuple[list[Event], bool]:
    """The events later than `after` of these jobs (id, history) and of the islands (unless None), a page."""
    evs = [e for span_id, history in spans for e in span_events(span_id, history) if e.at > after]
    if islands is not None:
        evs += islands.since(after)
    return page(evs)
