"""What the scheduler's loop tells whoever watches it (elasticd.observe serves it as metrics and a status page)."""

from __future__ import annotations

from typing import Protocol

from elasticd.scheduler.state import SchedulerState


class Watcher(Protocol):
    url: str

    def refresh(self, state: SchedulerState) -> None:
        """About once a second, from the loop: take a snapshot of the state for readers on other threads."""

    def request(self, op: str, seconds: float) -> None:
        """One request served, and how long it took."""

    def heartbeat(self) -> None:
        """One node heartbeat received."""

    def close(self) -> None:
        """Stop serving."""
