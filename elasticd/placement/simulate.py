"""A trace simulator of the island policy: today's uniform placement against the speed-aware one.

Pure and deterministic (a seed in, numbers out; no clock, no I/O). It drives the real policy functions
(`elasticd.scheduler.policy.place_grants` and `rebalance`) over a synthetic job trace on a fleet of devices
with fixed relative speeds, and reports each job's completion time (finish - arrival).

Units: a speed-1.0 device runs one logical worker-step per time unit. A step of a job laid out as blocks
n_i on devices of speed s_i takes max_i n_i / s_i plus a flush of comm_a + comm_b * 2(M-1)/M (the same for
both policies, unknown to both: each job is new when placed).

What it leaves out: live resizes cost nothing here (in the system they cost a snapshot and a restart of
seconds), speeds are known exactly (the speed-aware side is given them as priors, as
`elasticd start --device-speed` would; learning them is the cost model's job, tested on its own), and
every job has the same priority, so rule 5 (preemption) never fires.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from elasticd.placement.cost import CostModel, device_key, ring_shape
from elasticd.placement.placer import block_sizes, uniform_sizes
from elasticd.scheduler import policy

MIXED = ((1.0, 1.0, 1.0, 1.0), (0.5, 0.5, 0.5, 0.5), (1 / 3, 1 / 3, 1 / 3, 1 / 3))
UNIFORM = ((1.0, 1.0, 1.0, 1.0),) * 3


@dataclass(frozen=True, slots=True)
class SimJob:
    job_id: str
    arrival: float
    workers: int
    min_devices: int
    max_devices: int
    steps: int


@dataclass(frozen=True, slots=True)
class SimResult:
    jct: dict[str, float]        # job -> completion time (finish - arrival)

    @property
    def mean_jct(self) -> float:
        return sum(self.jct.values()) / len(self.jct)


def make_trace(seed: int, jobs: int = 60, mean_gap: float = 400.0) -> list[SimJob]:
    """Poisson arrivals; N from 1 to 16, elastic down to 1 device or rigid at N/2; 20..400 steps."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(jobs):
        t += rng.expovariate(1.0 / mean_gap)
        n = rng.choice([1, 2, 4, 4, 8, 8, 12, 16])
        lo, hi = (1, n) if rng.random() < 0.75 else (max(1, n // 2), max(1, n // 2))
        out.append(SimJob(f"j{i:03d}", t, n, lo, hi, rng.randint(20, 400)))
    return out


def _step(blocks: list[tuple[str, int]], speed: dict[str, float], comm_a: float, comm_b: float) -> float:
    m = len(blocks)
    flush = 0.0 if m == 1 else comm_a + comm_b * ring_shape(m)
    return max(n / speed[d] for d, n in blocks) + flush


@dataclass(slots=True)
class _Run:
    job: SimJob
    devices: list[tuple[str, str]]
    step_s: float
    left: float           # steps still to run
    since: float          # when `left` was last brought up to date


def simulate(trace: list[SimJob], fleet: tuple[tuple[float, ...], ...], speed_aware: bool,
             comm_a: float = 0.05, comm_b: float = 0.2) -> SimResult:
    """Run `trace` on `fleet` (per node, its devices' speeds) under one policy; every job finishes.

    Raises:
        ValueError: if a job could never start on this fleet.
    """
    speed = {device_key(f"n{i}", f"d{j}"): s for i, node in enumerate(fleet) for j, s in enumerate(node)}
    devices = [(f"n{i}", f"d{j}") for i, node in enumerate(fleet) for j in range(len(node))]
    if any(j.min_devices > len(devices) for j in trace):
        raise ValueError("a job needs more devices than the fleet has")
    costs = CostModel(speed) if speed_aware else None
    pending = sorted(trace, key=lambda j: (j.arrival, j.job_id))
    seq = {j.job_id: i for i, j in enumerate(pending)}
    queued: list[SimJob] = []
    running: dict[str, _Run] = {}
    jct: dict[str, float] = {}
    now = 0.0

    def layout(job: SimJob, devs: list[tuple[str, str]], blocks: tuple[int, ...] = ()) -> list[tuple[str, int]]:
        keys = [device_key(*d) for d in devs]
        if costs is not None:
            return list(block_sizes(job.workers, keys, costs, job.job_id).blocks)
        sizes = list(blocks) or uniform_sizes(job.workers, len(keys))
        return list(zip(keys, sizes, strict=True))

    while pending or queued or running:
        finish = min(((r.since + r.left * r.step_s, r.job.job_id) for r in running.values()), default=None)
        arrive = pending[0].arrival if pending else None
        if finish is not None and (arrive is None or finish[0] <= arrive):
            now = finish[0]
            done = running.pop(finish[1])
            jct[done.job.job_id] = now - done.job.arrival
        elif arrive is not None:
            now = arrive
            queued.append(pending.pop(0))
        else:
            raise ValueError(f"jobs {[j.job_id for j in queued]} can never start on this fleet")
        for r in running.values():   # bring every run up to now before layouts change
            r.left -= (now - r.since) / r.step_s
            r.since = now
        busy = {d for r in running.values() for d in r.devices}
        views = _views(fleet, busy)
        reqs = [policy.JobRequest(j.job_id, j.workers, j.min_devices, j.max_devices, 0, seq[j.job_id])
                for j in queued]
        grants = policy.place_grants(reqs, views, costs)
        for j in [j for j in queued if j.job_id in grants]:
            devs = list(grants[j.job_id].devices)
            running[j.job_id] = _Run(j, devs, _step(layout(j, devs), speed, comm_a, comm_b), j.steps, now)
            queued.remove(j)
        views = _views(fleet, {d for r in running.values() for d in r.devices})
        waiting = [r for r in reqs if r.job_id not in grants]
        elastic = [policy.RunningJob(r.job.job_id, r.job.workers, len(r.devices), r.job.min_devices,
                                     r.job.max_devices, 0, seq[r.job.job_id], tuple(r.devices))
                   for r in running.values() if r.job.min_devices < r.job.max_devices]
        for resize in policy.rebalance(waiting, elastic, views, costs):
            r = running[resize.job_id]
            if resize.devices <= len(r.devices):
                continue   # shrinks need a preemptor of higher priority: none in this trace
            extra = policy.spread(resize.devices - len(r.devices), views, costs, r.job.job_id)
            r.devices = r.devices + extra
            r.step_s = _step(layout(r.job, r.devices), speed, comm_a, comm_b)
            views = _views(fleet, {d for x in running.values() for d in x.devices})
    return SimResult(jct)


def _views(fleet: tuple[tuple[float, ...], ...], busy: set[tuple[str, str]]) -> list[policy.NodeView]:
    return [policy.NodeView(f"n{i}", tuple(f"d{j}" for j in range(len(node)) if (f"n{i}", f"d{j}") not in busy),
                            sum(1 for d in busy if d[0] == f"n{i}"), len(node))
            for i, node in enumerate(fleet)]


def compare(seeds: range, fleet: tuple[tuple[float, ...], ...], jobs: int = 60, mean_gap: float = 400.0
            ) -> tuple[float, float]:
    """(mean JCT uniform, mean JCT speed-aware) over the traces of `seeds`, each job weighing the same."""
    uniform = aware = 0.0
    for seed in seeds:
        trace = make_trace(seed, jobs, mean_gap)
        uniform += simulate(trace, fleet, False).mean_jct
        aware += simulate(trace, fleet, True).mean_jct
    return uniform / len(seeds), aware / len(seeds)
