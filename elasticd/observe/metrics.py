"""The scheduler's Prometheus metrics: a collector over the newest `Snapshot`, plus the loop's own counters.

Names follow Prometheus' conventions: the `elasticd_` prefix, base units (seconds, bytes), `_total` for
counters, labels for the dimensions (`job`, `node`, `state`, `outcome`, `op`). Gauges of jobs and nodes
are read from the snapshot at scrape time (`SnapshotCollector`), so a scrape costs the loop nothing.
Durations of resizes and recoveries are histograms, observed once per resize/recovery when it first shows
up in a snapshot (`Observer.refresh`), so they keep counting after a job is purged from the table.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from elasticd.core.lifecycle import JOB_ENDED
from elasticd.observe import snapshot as snap
from elasticd.scheduler.jobs import JobState
from elasticd.scheduler.state import SchedulerState

REFRESH_S = 1.0            # snapshots per second at most (the page polls at this rate too)
SAMPLE_S = 2.0             # history samples for the page's charts
# control-plane requests take ~0.1-2 ms on loopback (docs/benchmarks.md); resizes and recoveries seconds
_REQUEST_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)
_PHASE_BUCKETS = (0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class SnapshotCollector(Collector):
    """Gauges and counters of the island read from the newest snapshot (`get` returns it)."""

    def __init__(self, get) -> None:
        self._get = get

    def collect(self) -> Iterator[Any]:
        s: snap.Snapshot = self._get()
        by_state = {st.value: 0 for st in JobState}
        for j in s.jobs:
            by_state[j["state"]] = by_state.get(j["state"], 0) + 1
        jobs = GaugeMetricFamily("elasticd_jobs", "Jobs in the table, by state.", labels=["state"])
        for st, n in by_state.items():
            jobs.add_metric([st], n)
        yield jobs

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["job", "name", *extra])

        g = {k: gauge(f"elasticd_job_{k}", doc) for k, doc in (
            ("workers", "Logical workers (N) of a job."),
            ("devices", "Devices (M) a job runs on now (0 while queued)."),
            ("devices_min", "The fewest devices a job may run on."),
            ("devices_max", "The most devices a job may run on."),
            ("step", "The step rank 0 last reported."),
            ("steps_per_second", "Steps per second rank 0 last reported."),
            ("snapshot_bytes", "Bytes per agent of the newest complete periodic snapshot."),
            ("snapshot_step", "Step of the newest complete periodic snapshot (-1: none yet)."),
            ("snapshot_age_seconds", "Seconds since the newest snapshot's step was first reported."))}
        logged = gauge("elasticd_job_logged_value", "The last value of each scalar the job logs with ctx.log "
                       "(loss, ...).", ("metric",))
        resizes = CounterMetricFamily("elasticd_job_resizes", "Resizes of a job by outcome (the newest 100 "
                                      "a job keeps).", labels=["job", "name", "outcome"])
        recoveries = CounterMetricFamily("elasticd_job_recoveries", "Recoveries of a job after infrastructure "
                                         "failures, by outcome.", labels=["job", "name", "outcome"])
        for j in s.jobs:
            if j["state"] in JOB_ENDED:
                continue   # ended jobs stay in the table for days; their series would only pile up
            lab = [j["job"], j["name"]]
            for key, value in (("workers", j["workers"]), ("devices", j["devices"]),
                               ("devices_min", j["min_devices"]), ("devices_max", j["max_devices"]),
                               ("step", j["step"]), ("steps_per_second", j["steps_per_s"])):
                g[key].add_metric(lab, value)
            sn = j["snapshot"]
            if sn:
                g["snapshot_bytes"].add_metric(lab, float(sn.get("bytes") or 0))
                g["snapshot_step"].add_metric(lab, float(sn.get("step") if sn.get("step") is not None else -1))
                if sn.get("seen_at"):
                    g["snapshot_age_seconds"].add_metric(lab, max(0.0, s.at - sn["seen_at"]))
            for key, value in j["metrics"].items():
                logged.add_metric([*lab, str(key)], float(value))
            outcomes: dict[str, int] = {}
            for r in j["resizes"]:
                outcomes[str(r["outcome"])] = outcomes.get(str(r["outcome"]), 0) + 1
            for outcome, n in outcomes.items():
                resizes.add_metric([*lab, outcome], n)
            if j["recoveries"]:
                recoveries.add_metric([*lab, "recovered"], len(j["recoveries"]))
        yield from g.values()
        yield from (logged, resizes, recoveries)

        node_devices = GaugeMetricFamily("elasticd_node_devices", "Devices of a live node, free or busy.",
                                         labels=["node", "state"])
        node_up = GaugeMetricFamily("elasticd_node_up", "1 while the node heartbeats, 0 once lost.", labels=["node"])
        draining = GaugeMetricFamily("elasticd_node_draining", "1 while the node is being drained.", labels=["node"])
        rss = GaugeMetricFamily("elasticd_node_agents_resident_bytes", "Resident memory of the node's live "
                                "agents, summed.", labels=["node"])
        cpu = GaugeMetricFamily("elasticd_node_agents_cpu_percent", "CPU use of the node's live agents, summed "
                                "(100 = one core).", labels=["node"])
        seen = GaugeMetricFamily("elasticd_node_heartbeat_age_seconds", "Seconds since the node's last "
                                 "heartbeat.", labels=["node"])
        nodes = GaugeMetricFamily("elasticd_nodes", "Nodes the scheduler knows, alive or lost.", labels=["state"])
        speed = GaugeMetricFamily("elasticd_device_speed", "Relative speed of a live node's device (1.0 = "
                                  "reference): fitted from its agents' step times, else declared.",
                                  labels=["node", "device"])
        alive = 0
        for n in s.nodes:
            alive += bool(n["alive"])
            node_up.add_metric([n["node"]], 1 if n["alive"] else 0)
            draining.add_metric([n["node"]], 1 if n["draining"] else 0)
            seen.add_metric([n["node"]], n["last_seen_s"])
            if n["alive"]:
                node_devices.add_metric([n["node"], "free"], n["free"])
                node_devices.add_metric([n["node"], "busy"], n["busy"])
                rss.add_metric([n["node"]], n["rss_bytes"])
                cpu.add_metric([n["node"]], n["cpu_percent"])
                for dev, v in n.get("speeds", {}).items():
                    speed.add_metric([n["node"], dev], v)
        nodes.add_metric(["alive"], alive)
        nodes.add_metric(["lost"], len(s.nodes) - alive)
        yield from (node_devices, node_up, draining, rss, cpu, seen, nodes, speed)


class Observer:
    """What the scheduler loop feeds (`request`, `heartbeat`, `refresh`) and the HTTP thread reads
    (`snapshot`, `registry`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Histogram("elasticd_scheduler_request_duration_seconds", "Time the scheduler took to "
                                  "serve one message, by type.", ["op"], buckets=_REQUEST_BUCKETS,
                                  registry=self.registry)
        self.heartbeats = Counter("elasticd_scheduler_heartbeats", "Node heartbeats received.",
                                  registry=self.registry)
        self.resize_s = Histogram("elasticd_resize_duration_seconds", "Resizes from the request to the first "
                                  "step at the new size, by outcome.", ["outcome"], buckets=_PHASE_BUCKETS,
                                  registry=self.registry)
        self.recovery_s = Histogram("elasticd_recovery_duration_seconds", "Recoveries from the failure to the "
                                    "first step after it.", buckets=_PHASE_BUCKETS, registry=self.registry)
        self.registry.register(SnapshotCollector(lambda: self.snapshot))
        self.snapshot: snap.Snapshot = snap.empty()   # replaced whole, never mutated: see the package doc
        self._history = snap.History()
        self._next_refresh = 0.0
        self._next_sample = 0.0
        self._counted: set[tuple] = set()
        self._snap_seen: dict[str, tuple[Any, float]] = {}   # job -> (snapshot step, when first reported)

    def request(self, op: str, seconds: float) -> None:
        self.requests.labels(op).observe(seconds)

    def refresh(self, state: SchedulerState, now: float | None = None) -> None:
        """Publish a new snapshot if the last is older than REFRESH_S. Loop thread only."""
        mono = time.monotonic()
        if mono < self._next_refresh:
            return
        self._next_refresh = mono + REFRESH_S
        sample = mono >= self._next_sample
        if sample:
            self._next_sample = mono + SAMPLE_S
        now = time.time() if now is None else now
        s = snap.take(state, now, self._history if sample else None)
        if not sample:   # keep the charts of the last sample
            s = snap.Snapshot(at=s.at, jobs=s.jobs, nodes=s.nodes, series=self.snapshot.series,
                              alloc=self.snapshot.alloc)
        self._count(s)
        self.snapshot = s

    def _count(self, s: snap.Snapshot) -> None:
        live: set[tuple] = set()
        for j in s.jobs:
            for r in j["resizes"]:
                key = ("resize", j["job"], r["at"], r["to"])
                live.add(key)
                if key not in self._counted and isinstance(r.get("seconds"), int | float):
                    self.resize_s.labels(str(r["outcome"])).observe(r["seconds"])
            for r in j["recoveries"]:
                key = ("recovery", j["job"], r["at"])
                live.add(key)
                if key not in self._counted and isinstance(r.get("seconds"), int | float):
                    self.recovery_s.observe(r["seconds"])
            sn = j["snapshot"]
            if sn:
                step = sn.get("step")
                prev = self._snap_seen.get(j["job"])
                seen_at = prev[1] if prev is not None and prev[0] == step else s.at
                self._snap_seen[j["job"]] = (step, seen_at)
                sn["seen_at"] = seen_at
        self._counted = live   # forget what left the table, so the set stays as small as the table
        gone = {j["job"] for j in s.jobs}
        for job_id in [k for k in self._snap_seen if k not in gone]:
            del self._snap_seen[job_id]


def markdown_table() -> str:
    """The metric list docs/observability.md shows (a test keeps the two equal): every family an `Observer`
    exports, with its type, labels and help text as the code declares them."""
    obs = Observer()
    # Families a collector builds carry their label names; metrics prometheus_client keeps itself name theirs.
    declared = {m._name: m._labelnames for m in (obs.requests, obs.heartbeats, obs.resize_s, obs.recovery_s)}
    rows = ["| metric | type | labels | what |", "|---|---|---|---|"]
    for fam in sorted(obs.registry.collect(), key=lambda f: f.name):
        labels = tuple(getattr(fam, "_labelnames", ()) or declared.get(fam.name, ()))
        name = fam.name + ("_total" if fam.type == "counter" else "")
        shown = ", ".join(f"`{x}`" for x in labels)
        rows.append(f"| `{name}` | {fam.type} | {shown} | {fam.documentation} |")
    return "\n".join(rows)
