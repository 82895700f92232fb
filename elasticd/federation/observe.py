"""The federation front's metrics and status page (`elasticd federation --metrics ADDR:PORT`): its jobs
spanning islands with their portions per island, and its islands, as an island's scheduler shows its own
(elasticd/observe): Prometheus text at /metrics, the page at /, its JSON at /api/status.json.

The loop thread takes a `FrontSnapshot` at most once a second (plain data, replaced whole, never mutated);
the HTTP thread reads only that and Prometheus' registry.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from elasticd.federation.spans import ENDED, Spans
from elasticd.federation.state import FederationState
from elasticd.observe.http import ObserveHTTP
from elasticd.observe.metrics import REFRESH_S

STATES = ("waiting", "reserving", "starting", "running", "moving", "recovering", "finished", "failed", "stopped")
ISLAND_STATES = ("up", "lost", "left")
SHOWN_ENDED = 50   # ended jobs the page lists (the newest); their metrics are not exported
_REQUEST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)


@dataclass(frozen=True, slots=True)
class FrontSnapshot:
    at: float
    jobs: tuple[dict[str, Any], ...] = ()
    islands: tuple[dict[str, Any], ...] = ()


def take(spans: Spans, state: FederationState, now: float) -> FrontSnapshot:
    ordered = sorted(spans.spans.values(), key=lambda s: s.seq)
    ended = [s for s in ordered if s.state in ENDED][-SHOWN_ENDED:]
    jobs = []
    for s in [s for s in ordered if s.state not in ENDED] + ended:
        info = s.info()
        jobs.append({"job": info.span_id, "name": info.name, "state": info.state, "reason": info.reason,
                     "workers": info.workers, "devices": info.devices, "step": info.step,
                     "steps_per_s": info.steps_per_s, "restarts": info.restarts, "attempt": info.attempt,
                     "moves": s.moves, "owner": info.owner, "submitted_at": info.submitted_at,
                     "portions": [asdict(pt) for pt in info.portions]})
    islands = [{"island": i.island_id, "state": i.state, "reason": i.reason, "last_seen_s": round(now - i.last_seen, 3),
                **{k: v for k, v in asdict(i.capacity).items() if k != "device_types"}}
               for i in sorted(state.islands.values(), key=lambda i: i.island_id)]
    return FrontSnapshot(at=now, jobs=tuple(jobs), islands=tuple(islands))


class FrontCollector(Collector):
    def __init__(self, get) -> None:
        self._get = get

    def collect(self) -> Iterator[Any]:
        s: FrontSnapshot = self._get()
        by_state = dict.fromkeys(STATES, 0)
        for j in s.jobs:
            by_state[j["state"]] = by_state.get(j["state"], 0) + 1
        jobs = GaugeMetricFamily("elasticd_front_jobs", "Jobs spanning islands at the front, by state (ended ones: "
                                 "the newest the page lists).", labels=["state"])
        for st, n in by_state.items():
            jobs.add_metric([st], n)
        yield jobs
        lab = ["job", "name"]
        devices = GaugeMetricFamily("elasticd_front_job_devices", "Devices (agents) of a job spanning islands, by "
                                    "island: its portion there.", labels=[*lab, "island"])
        workers = GaugeMetricFamily("elasticd_front_job_workers", "Logical workers of a job spanning islands its "
                                    "portion on an island hosts.", labels=[*lab, "island"])
        step = GaugeMetricFamily("elasticd_front_job_step", "The step its portion hosting rank 0 last reported.",
                                 labels=lab)
        rate = GaugeMetricFamily("elasticd_front_job_steps_per_second", "Steps per second its portion hosting "
                                 "rank 0 last reported.", labels=lab)
        restarts = CounterMetricFamily("elasticd_front_job_restarts", "Restarts of a job spanning islands after "
                                       "infrastructure failures.", labels=lab)
        moves = CounterMetricFamily("elasticd_front_job_live_moves", "Live moves of a job spanning islands in its "
                                    "current attempt (grown onto an island back, moved off a drain or a "
                                    "preemption).", labels=lab)
        for j in s.jobs:
            if j["state"] in ENDED:
                continue
            key = [j["job"], j["name"]]
            for pt in j["portions"]:
                devices.add_metric([*key, pt["island"]], pt["devices"])
                workers.add_metric([*key, pt["island"]], pt["workers"])
            step.add_metric(key, j["step"])
            rate.add_metric(key, j["steps_per_s"])
            restarts.add_metric(key, j["restarts"])
            moves.add_metric(key, j["moves"])
        yield from (devices, workers, step, rate, restarts, moves)
        up = GaugeMetricFamily("elasticd_island_up", "1 while the island's scheduler reports, 0 once lost or "
                               "gone.", labels=["island"])
        isl_devices = GaugeMetricFamily("elasticd_island_devices", "Devices of an island's live nodes, free or "
                                        "busy, as it last reported.", labels=["island", "state"])
        seen = GaugeMetricFamily("elasticd_island_status_age_seconds", "Seconds since the island's last status.",
                                 labels=["island"])
        for i in s.islands:
            up.add_metric([i["island"]], 1 if i["state"] == "up" else 0)
            seen.add_metric([i["island"]], i["last_seen_s"])
            isl_devices.add_metric([i["island"], "free"], i["free"])
            isl_devices.add_metric([i["island"], "busy"], max(0, i["devices"] - i["free"]))
        yield from (up, isl_devices, seen)


class FrontObserver:
    """What the front's loop feeds (`request`, `refresh`) and the HTTP thread reads (`snapshot`, `registry`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Histogram("elasticd_front_request_duration_seconds", "Time the front took to serve one "
                                  "message, by type.", ["op"], buckets=_REQUEST_BUCKETS, registry=self.registry)
        self.statuses = Counter("elasticd_front_island_statuses", "Island statuses received.",
                                registry=self.registry)
        self.registry.register(FrontCollector(lambda: self.snapshot))
        self.snapshot = FrontSnapshot(at=0.0)
        self._next = 0.0

    def request(self, op: str, seconds: float) -> None:
        self.requests.labels(op).observe(seconds)

    def refresh(self, spans: Spans, state: FederationState, now: float | None = None) -> None:
        mono = time.monotonic()
        if mono < self._next:
            return
        self._next = mono + REFRESH_S
        self.snapshot = take(spans, state, time.time() if now is None else now)


def front_doc(observer: FrontObserver) -> dict[str, Any]:
    s = observer.snapshot
    return {"at": s.at, "jobs": list(s.jobs), "islands": list(s.islands)}


class FrontWatch:
    """A `FrontObserver` and the HTTP server that publishes it.

    Raises:
        OSError: the address cannot be bound.
    """

    def __init__(self, host: str, port: int) -> None:
        self.observer = FrontObserver()
        self.http = ObserveHTTP(self.observer, host, port, page="front.html", doc=front_doc)

    @property
    def url(self) -> str:
        return self.http.url

    def close(self) -> None:
        self.http.close()
