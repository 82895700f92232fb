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

Speed-aware (when a `CostModel` is passed): rules 3, 4 and 6 ask the placer instead of
ceil(N/M). A job gets the M, and the devices, with the shortest predicted step (busiest device's n_i * c_i
plus the flush at M), taking the fastest free devices -- ties going to the order of rule 4 -- and its
ranks then grouped by node as in rule 4, with block sizes fitted to the chosen devices. When every device
has the same speed and no flush cost is known, this is exactly the rules above (the tests check it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from elasticd.placement import CostModel, block_sizes, choose, device_key


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


def spread_order(nodes: Sequence[NodeView]) -> list[tuple[str, str]]:
    """Every free device in the order rule 4 picks them: each next one from the node with the most free
    devices left, then the least loaded, then the first listed."""
    free = {n.node_id: list(n.free) for n in nodes}
    load = {n.node_id: n.load for n in nodes}
    order = {n.node_id: i for i, n in enumerate(nodes)}
    picks: list[tuple[str, str]] = []
    for _ in range(sum(len(v) for v in free.values())):
        node = min((n for n in free if free[n]),
                   key=lambda n: (-len(free[n]), load[n], order[n]))
        picks.append((node, free[node].pop(0)))
        load[node] += 1
    return picks


def group_by_node(picks: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """Ranks grouped by node (contiguous per node: cheaper ring collectives), nodes in first-picked order."""
    nodes: dict[str, list[tuple[str, str]]] = {}
    for pick in picks:
        nodes.setdefault(pick[0], []).append(pick)
    return [pick for group in nodes.values() for pick in group]


def spread(count: int, nodes: Sequence[NodeView], costs: CostModel | None = None, job_id: str = ""
           ) -> list[tuple[str, str]]:
    """Pick `count` free devices spread across nodes; ranks grouped by node, in rank order.

    With `costs`: the `count` fastest for `job_id`, ties in the order above.

    Raises:
        ValueError: if fewer than `count` devices are free.
    """
    order = spread_order(nodes)
    if len(order) < count:
        raise ValueError(f"{count} devices requested, fewer free")
    if costs is not None:
        c = costs.estimates(job_id, [device_key(*p) for p in order])
        order = sorted(order, key=lambda p: c[device_key(*p)])   # stable: ties keep rule 4's order
    picked = set(order[:count])
    return group_by_node([p for p in spread_order(nodes) if p in picked])


@dataclass(frozen=True, slots=True)
class Allotment:
    """Where a queued job starts: its devices in rank order and the logical workers each hosts."""

    devices: tuple[tuple[str, str], ...]
    blocks: tuple[int, ...] = ()     # sizes in agent order; () = today's uniform layout
    predicted_s: float = 0.0         # the model's step time (0.0 without a model)


def place(queued: Sequence[JobRequest], nodes: Sequence[NodeView], costs: CostModel | None = None
          ) -> dict[str, list[tuple[str, str]]]:
    """Decide which queued jobs start now: job id -> [(node, device)] in rank order.

    `nodes` are the live nodes with their currently free devices.
    """
    return {job: list(g.devices) for job, g in place_grants(queued, nodes, costs).items()}


def place_grants(queued: Sequence[JobRequest], nodes: Sequence[NodeView], costs: CostModel | None = None
                 ) -> dict[str, Allotment]:
    """`place` with the block sizes: speed-aware with `costs` (the header's last paragraph)."""
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
    out: dict[str, Allotment] = {}
    views = list(nodes)
    for job in order:   # by priority: the first job's count is settled before the next's
        if job.job_id not in granted:
            continue
        have = granted[job.job_id]
        hi = have if job.fixed is not None else max(have, min(job.max_devices, job.workers, have + avail))
        if costs is None:
            m = best_device_count(job.workers, have, hi) if hi > have else have
            grant = Allotment(tuple(spread(m, views)))
        else:
            grant = _speed_aware(job, views, have, hi, costs)
        avail -= len(grant.devices) - have
        out[job.job_id] = grant
        taken: dict[str, set[str]] = {}
        for node, dev in grant.devices:
            taken.setdefault(node, set()).add(dev)
        views = [NodeView(v.node_id, tuple(d for d in v.free if d not in taken.get(v.node_id, ())),
                          v.load + len(taken.get(v.node_id, ())), v.total) for v in views]
    return out


def _speed_aware(job: JobRequest, views: Sequence[NodeView], lo: int, hi: int, costs: CostModel) -> Allotment:
    order = spread_order(views)
    keys = {device_key(*p): p for p in order}
    pick = choose(job.workers, list(keys), lo, hi, costs, job.job_id)
    devices = group_by_node([keys[k] for k in pick.devices])
    final = block_sizes(job.workers, [device_key(*p) for p in devices], costs, job.job_id)
    return Allotment(tuple(devices), tuple(final.layout()), final.predicted_s)


@dataclass(frozen=True, slots=True)
class RunningJob:
    """A running job the policy may resize live."""

    job_id: str
    workers: int
    devices: int                 # current M
    min_devices: int             # 0: it may give every device back (a portion of a job spanning islands)
    max_devices: int
    priority: int = 0
    seq: int = 0
    placed: tuple[tuple[str, str], ...] = ()   # its devices in rank order (speed-aware growth needs them)


@dataclass(frozen=True, slots=True)
class ResizeOrder:
    job_id: str
    devices: int
    why: str


def rebalance(queued: Sequence[JobRequest], running: Sequence[RunningJob], nodes: Sequence[NodeView],
              costs: CostModel | None = None) -> list[ResizeOrder]:
    """Live resizes the policy wants now (rules 5 and 6), given the jobs `place` could not start.

    `running` lists only jobs that may be resized (elastic, not pinned, not resizing already). With
    `costs`, a job whose `placed` devices are given grows only when the model predicts a shorter step on
    its devices plus the fastest free ones (which `spread(..., costs)` then picks).
    """
    island = sum(max(n.total, len(n.free)) for n in nodes)
    avail = sum(len(n.free) for n in nodes)
    order = sorted(queued, key=lambda j: (-j.priority, j.seq))
    head = next((j for j in order if (j.fixed if j.fixed is not None else j.min_devices) <= island), None)
    if head is not None:
        return _preempt(head, running, avail)
    out: list[ResizeOrder] = []
    views = list(nodes)
    for job in sorted(running, key=lambda j: (-j.priority, j.seq)):
        hi = min(job.max_devices, job.workers, job.devices + avail)
        if hi <= job.devices:
            continue
        if costs is not None and job.placed:
            extra = _growth(job, hi, views, costs)
            if extra:
                out.append(ResizeOrder(job.job_id, job.devices + len(extra), "policy: grow into freed devices"))
                avail -= len(extra)
                views = [NodeView(v.node_id, tuple(d for d in v.free if (v.node_id, d) not in extra),
                                  v.load + sum(1 for n, _ in extra if n == v.node_id), v.total) for v in views]
            continue
        m = best_device_count(job.workers, job.devices, hi)
        if ceil_div(job.workers, m) < ceil_div(job.workers, job.devices):
            out.append(ResizeOrder(job.job_id, m, "policy: grow into freed devices"))
            avail -= m - job.devices
    return out


def _growth(job: RunningJob, hi: int, views: Sequence[NodeView], costs: CostModel) -> set[tuple[str, str]]:
    """The free devices worth adding to `job` (none when no growth shortens its predicted step)."""
    have = [device_key(*p) for p in job.placed]
    free = spread(min(hi, sum(len(v.free) for v in views) + job.devices) - job.devices, views, costs, job.job_id)
    c = costs.estimates(job.job_id, [device_key(*p) for p in free])
    free.sort(key=lambda p: c[device_key(*p)])   # stable: fastest first
    best, take = block_sizes(job.workers, have, costs, job.job_id).predicted_s, 0
    for k in range(1, len(free) + 1):
        step = block_sizes(job.workers, have + [device_key(*p) for p in free[:k]], costs, job.job_id).predicted_s
        if step < best * (1 - 1e-9):
            best, take = step, k
    return set(free[:take])


def _preempt(head: JobRequest, running: Sequence[RunningJob], avail: int) -> list[ResizeOrder]:
    need = head.fixed if head.fixed is not None else head.min_devices
    deficit = need - avail
    if deficit <= 0:   # it fits: `place` starts it (or will, once devices being freed are)
        return []
    victims = sorted((j for j in running if j.priority < head.priority and j.devices > j.min_devices),
                     key=lambda j: (j.priority, -j.seq))
    out: list[ResizeOrder] = []
    for job in victims:
        if deficit <= 0:
            break
        floor = max(job.min_devices, job.devices - deficit)
        target = best_device_count(job.workers, job.min_devices, floor) if floor > 0 else 0
        out.append(ResizeOrder(job.job_id, target, f"policy: preempted by job {head.job_id}"))
        deficit -= job.devices - target
    return out if deficit <= 0 else []
