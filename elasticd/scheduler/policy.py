"""Placement policy: which queued jobs start now, on how many devices, and where. Pure functions.

Rules, in order:
1. Jobs are considered by priority (higher first), then submission order.
2. Gang placement: a job gets at least its minimum (or the M fixed by `elasticd scale`) or nothing.
   A job that does not fit blocks the jobs behind it (no backfill), so a wide high-priority job is
   not starved by a stream of narrow ones -- except a job wider than the whole island, which could
   never start and is skipped.
3. Devices left over go to the jobs started in this round, by priority, up to their maximum. A job
   with N workers on M devices steps as slowly as its busiest device, which hosts ceil(N/M) workers,
   so extra devices are only worth taking when they lower ceil(N/M); among the M that reach the same
   ceil(N/M) the smallest is taken. This prefers M dividing N (N=8: 1, 2, 4, 8) and never takes
   devices that would sit partly idle.
4. Devices are spread over nodes: each next device comes from the node with the most free devices
   (then the least loaded), and ranks are then grouped by node so that a job's ranks on one node are
   contiguous (cheaper ring collectives), rank 0 on the first node.

Elasticity (`rebalance`, for running jobs that may change size live: min < max, not pinned by
`elasticd scale`):
5. Preemption: when the first queued job (in the order of rule 1) does not fit, running elastic jobs of
   lower priority shrink toward their minimum -- lowest priority first, then the most recently
   submitted -- just enough to make room, each to a size per rule 3 (N=4 goes 4 -> 2, not 4 -> 3,
   which steps no faster than 2). If even that cannot make room, nobody shrinks for nothing.
6. Growth: when nothing that could start is queued, running elastic jobs take free devices up to
   their maximum, by priority, whenever that lowers their workers per device (rule 3).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class NodeView:
    node_id: str
    free: tuple[str, ...]        # free device ids, in the node's order
    load: int = 0                # agents currently running on the node
    total: int = 0               # all devices of the node, free or not


@dataclass(frozen=True, slots=True)
class JobRequest:
    job_id: str
    workers: int
    min_devices: int
    max_devices: int
    priority: int = 0
    seq: int = 0
    fixed: int | None = None     # M requested by `scale` for a queued job


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def best_device_count(workers: int, lo: int, hi: int) -> int:
    """The smallest M in [lo, hi] with the fewest workers per device (ceil(N/M) minimal)."""
    if lo > hi:
        raise ValueError(f"empty range [{lo}, {hi}]")
    target = ceil_div(workers, hi)
    m = max(lo, ceil_div(workers, target))
    return min(m, hi)


def spread(count: int, nodes: Sequence[NodeView]) -> list[tuple[str, str]]:
    """Pick `count` free devices spread across nodes; ranks grouped by node, in rank order.

    Raises:
        ValueError: if fewer than `count` devices are free.
    """
    free = {n.node_id: list(n.free) for n in nodes}
    load = {n.node_id: n.load for n in nodes}
    order = {n.node_id: i for i, n in enumerate(nodes)}
    if sum(len(v) for v in free.values()) < count:
        raise ValueError(f"{count} devices requested, fewer free")
    picked: dict[str, list[str]] = {}
    first: dict[str, int] = {}
    for i in range(count):
        node = min((n for n in free if free[n]),
                   key=lambda n: (-len(free[n]), load[n], order[n]))
        picked.setdefault(node, []).append(free[node].pop(0))
        first.setdefault(node, i)
        load[node] += 1
    return [(node, dev) for node in sorted(picked, key=first.__getitem__) for dev in picked[node]]


def place(queued: Sequence[JobRequest], nodes: Sequence[NodeView]) -> dict[str, list[tuple[str, str]]]:
    """Decide which queued jobs start now: job id -> [(node, device)] in rank order.

    `nodes` are the live nodes with their currently free devices.
    """
    island = sum(max(n.total, len(n.free)) for n in nodes)
    avail = sum(len(n.free) for n in nodes)
    order = sorted(queued, key=lambda j: (-j.priority, j.seq))
    granted: dict[str, int] = {}
    for job in order:
        need = job.fixed if job.fixed is not None else job.min_devices
        if need > island:
            continue
        if need > avail:
            break
        granted[job.job_id] = need
        avail -= need
    for job in order:
        if job.job_id not in granted or job.fixed is not None:
            continue
        have = granted[job.job_id]
        hi = min(job.max_devices, job.workers, have + avail)
        m = best_device_count(job.workers, have, hi) if hi > have else have
        avail -= m - have
        granted[job.job_id] = m
    out: dict[str, list[tuple[str, str]]] = {}
    views = list(nodes)
    for job in order:
        if job.job_id not in granted:
            continue
        chosen = spread(granted[job.job_id], views)
        out[job.job_id] = chosen
        taken: dict[str, set[str]] = {}
        for node, dev in chosen:
            taken.setdefault(node, set()).add(dev)
        views = [NodeView(v.node_id, tuple(d for d in v.free if d not in taken.get(v.node_id, ())),
                          v.load + len(taken.get(v.node_id, ())), v.total) for v in views]
    return out


@dataclass(frozen=True, slots=True)
class RunningJob:
    """A running job the policy may resize live."""

    job_id: str
    workers: int
    devices: int                 # current M
    min_devices: int
    max_devices: int
    priority: int = 0
    seq: int = 0


@dataclass(frozen=True, slots=True)
class Resize:
    job_id: str
    devices: int
    why: str


def rebalance(queued: Sequence[JobRequest], running: Sequence[RunningJob], nodes: Sequence[NodeView]
              ) -> list[Resize]:
    """Live resizes the policy wants now (rules 5 and 6), given the jobs `place` could not start.

    `running` lists only jobs that may be resized (elastic, not pinned, not resizing already).
    """
    island = sum(max(n.total, len(n.free)) for n in nodes)
    avail = sum(len(n.free) for n in nodes)
    order = sorted(queued, key=lambda j: (-j.priority, j.seq))
    head = next((j for j in order if (j.fixed if j.fixed is not None else j.min_devices) <= island), None)
    if head is not None:
        return _preempt(head, running, avail)
    out: list[Resize] = []
    for job in sorted(running, key=lambda j: (-j.priority, j.seq)):
        hi = min(job.max_devices, job.workers, job.devices + avail)
        if hi <= job.devices:
            continue
        m = best_device_count(job.workers, job.devices, hi)
        if ceil_div(job.workers, m) < ceil_div(job.workers, job.devices):
            out.append(Resize(job.job_id, m, "policy: grow into freed devices"))
            avail -= m - job.devices
    return out


def _preempt(head: JobRequest, running: Sequence[RunningJob], avail: int) -> list[Resize]:
    need = head.fixed if head.fixed is not None else head.min_devices
    deficit = need - avail
    if deficit <= 0:   # it fits: `place` starts it (or will, once devices being freed are)
        return []
    victims = sorted((j for j in running if j.priority < head.priority and j.devices > j.min_devices),
                     key=lambda j: (j.priority, -j.seq))
    out: list[Resize] = []
    for job in victims:
        if deficit <= 0:
            break
        target = best_device_count(job.workers, job.min_devices, max(job.min_devices, job.devices - deficit))
        out.append(Resize(job.job_id, target, f"policy: preempted by job {head.job_id}"))
        deficit -= job.devices - target
    return out if deficit <= 0 else []
