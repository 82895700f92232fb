"""A plain-data picture of the scheduler's tables, taken in the loop thread and read by the HTTP thread.

Everything here is built from fresh dicts, lists and tuples that nothing mutates after `take` returns, so
handing the result to another thread needs no lock. `History` keeps each job's progress over time (what
the page charts): a bounded ring per job, sampled in the loop.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from elasticd.core.lifecycle import JOB_ENDED
from elasticd.scheduler.jobs import Job
from elasticd.scheduler.state import SchedulerState

# The page fetches every chart once a second: 20 jobs x 450 points is ~0.5 MB of JSON at most.
HISTORY_POINTS = 450       # per job; one every `metrics.SAMPLE_S` (2 s): the last 15 minutes
HISTORY_JOBS = 20          # jobs charted: active ones first, then the most recently ended
_TERMINAL = JOB_ENDED


@dataclass(frozen=True, slots=True)
class Snapshot:
    at: float
    jobs: tuple[dict[str, Any], ...] = ()
    nodes: tuple[dict[str, Any], ...] = ()
    series: dict[str, tuple[tuple, ...]] = field(default_factory=dict)   # job -> (t, step, steps/s, loss, M)
    alloc: tuple[tuple, ...] = ()   # (t, {node: busy devices}) samples: device allocation over time


def _loss(metrics: dict[str, Any]) -> float | None:
    v = metrics.get("loss")
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


def job_row(job: Job) -> dict[str, Any]:
    """What the page and the metrics use of one job: copies of a few fields, not the whole status row
    (its history, agents' reports and the like would make a snapshot of a big table cost the loop ms)."""
    active = job.state.active
    return {"job": job.job_id, "name": job.spec.name, "state": job.state.value, "workers": job.spec.workers,
            "devices": len(job.placement) if (active or job.state.terminal) else 0,
            "min_devices": job.spec.min_devices, "max_devices": job.spec.max_devices,
            "nodes": job.nodes, "step": job.step, "steps_per_s": job.steps_per_s, "loss": _loss(job.metrics),
            "metrics": {k: v for k, v in job.metrics.items()
                        if isinstance(v, int | float) and not isinstance(v, bool)},
            "resizes": [{"at": r.at, "from": r.src, "to": r.dst, "why": r.why, "outcome": r.outcome,
                         "seconds": r.seconds} for r in job.resizes],
            "resizing": {"from": job.resize.src, "to": job.resize.dst} if job.resize is not None else None,
            "recoveries": [{"at": r.at, "cause": r.cause, "seconds": r.seconds} for r in job.recoveries],
            "snapshot": dict(job.snapshot) if job.snapshot else None,
            "agents": [{"node": a.node, "alive": a.alive, "rss": a.rss, "cpu": a.cpu}
                       for agents in job.agents.values() for a in agents] if active else [],
            # Not the error's text: the page and /api/status.json are unauthenticated, and an error message or
            # traceback is its owner's (`elasticd status JOB` shows it to the owner and admins).
            "error": f"failed ({(job.error or {}).get('cause') or 'error'}): elasticd status {job.job_id}"
                     if job.error else None}


class History:
    """Per-job progress samples and per-node allocation samples, bounded. Loop thread only."""

    def __init__(self, points: int = HISTORY_POINTS, jobs: int = HISTORY_JOBS) -> None:
        self.points = points
        self.max_jobs = jobs
        self._jobs: dict[str, deque[tuple]] = {}
        self._alloc: deque[tuple] = deque(maxlen=points)

    def sample(self, now: float, jobs: list[dict[str, Any]], nodes: list[dict[str, Any]]) -> None:
        """`jobs` in submission order. Charted: the newest `max_jobs` of those running (or charted while
        they ran, ended since), active ones first; the same ones from one sample to the next."""
        candidates = [(j["state"] not in _TERMINAL, i, j) for i, j in enumerate(jobs)
                      if j["state"] not in _TERMINAL or j["job"] in self._jobs]
        chosen = [j for _a, _i, j in sorted(candidates, key=lambda c: (c[0], c[1]), reverse=True)[:self.max_jobs]]
        keep = {j["job"] for j in chosen}
        for job_id in [k for k in self._jobs if k not in keep]:
            del self._jobs[job_id]   # purged from the table, or pushed out by newer jobs
        for j in chosen:
            ring = self._jobs.setdefault(j["job"], deque(maxlen=self.points))
            if j["state"] in _TERMINAL and ring and ring[-1][5] in _TERMINAL:
                continue   # one sample after the end is enough
            ring.append((round(now, 3), j["step"], round(j["steps_per_s"], 4), j["loss"], j["devices"], j["state"]))
        self._alloc.append((round(now, 3), {n["node"]: n["busy"] for n in nodes if n["alive"]}))

    def frozen(self) -> tuple[dict[str, tuple[tuple, ...]], tuple[tuple, ...]]:
        return {k: tuple(v) for k, v in self._jobs.items()}, tuple(self._alloc)


def take(state: SchedulerState, now: float, history: History | None = None) -> Snapshot:
    """Read the tables (loop thread only) into a `Snapshot`; sample `history` too when given."""
    jobs = [job_row(j) for j in sorted(state.jobs.values(), key=lambda j: j.seq)]
    agents: dict[str, list[dict[str, Any]]] = {}
    for j in jobs:
        if j["state"] not in _TERMINAL:
            for a in j["agents"]:
                agents.setdefault(str(a["node"]), []).append(a)
    nodes = []
    for n in state.node_infos(now):
        live = [a for a in agents.get(n.node_id, []) if a.get("alive")]
        nodes.append({"node": n.node_id, "host": n.host, "alive": n.alive, "devices": len(n.devices),
                      "free": len(n.free), "busy": len(n.devices) - len(n.free), "last_seen_s": n.last_seen_s,
                      "draining": n.draining is not None, "drained": bool((n.draining or {}).get("drained")),
                      "agents": len(live), "rss_bytes": sum(int(a.get("rss") or 0) for a in live),
                      "cpu_percent": round(sum(float(a.get("cpu") or 0.0) for a in live), 1),
                      "speeds": dict(n.speeds)})
    series: dict[str, tuple[tuple, ...]] = {}
    alloc: tuple[tuple, ...] = ()
    if history is not None:
        history.sample(now, jobs, nodes)
        series, alloc = history.frozen()
    return Snapshot(at=now, jobs=tuple(jobs), nodes=tuple(nodes), series=series, alloc=alloc)


def empty() -> Snapshot:
    return Snapshot(at=time.time())
