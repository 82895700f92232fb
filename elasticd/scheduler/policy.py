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
