"""The scheduler's metrics and status page served over HTTP: what the daemon or `elasticd scheduler` hands
the scheduler when `--metrics` is given."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from elasticd.observe.http import ObserveHTTP
from elasticd.observe.metrics import Observer


class Watch:
    """An `Observer` and the HTTP server that publishes it.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, host: str, port: int) -> None:
        self.observer = Observer()
        self.http = ObserveHTTP(self.observer, host, port)

    @property
    def url(self) -> str:
        return self.http.url

    def refresh(self, state: Any) -> None:
        self.observer.refresh(state)

    def request(self, op: str, seconds: float) -> None:
        self.observer.request(op, seconds)

    def heartbeat(self) -> None:
        self.observer.heartbeats.inc()

    def close(self) -> None:
        self.http.close()


def watch_at(addr: tuple[str, int] | None) -> Callable[[], Watch] | None:
    """What `SchedulerServer(watch=...)` takes for an `--metrics` address (None: not watched)."""
    return None if addr is None else (lambda: Watch(*addr))
