"""A federation front's events, for `elasticd events` asked of the front: read off its jobs' histories
(elasticd/federation/spans.py), plus a small log of island events. Pure, like the scheduler's
(elasticd/scheduler/events.py), whose paging it shares."""

from __future__ import annotations

from elasticd.protocol.events import Event
from elasticd.scheduler.events import EventLog, page

ISLAND_EVENTS = ("island_joined", "island_lost", "island_back", "island_left")


class IslandEvents(EventLog):
    """The newest island events (islands have no table row a restarted front would keep)."""

    def __init__(self) -> None:
        super().__init__(ISLAND_EVENTS, "island")


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
