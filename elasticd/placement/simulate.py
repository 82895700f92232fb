"""A trace simulator of the island policy: today's uniform placement against the speed-aware one.

Pure and deterministic (a seed in, numbers out; no clock, no I/O). It drives the real policy functions
(`elasticd.placement.policy.place_grants` and `rebalance`) over a synthetic job trace on a fleet of devices
with fixed relative speeds, and reports each job's completion time (finish - arrival).

Units: a speed-1.0 device runs one logical worker-step per time unit. A step of a job laid out as blocks
n_i on devices of speed s_i takes max_i n_i / s_i plus a flush of comm_a + comm_b * 2(M-1)/M (the same for
both policies, unknown to both: each job is new when placed).

The speed-aware side is either given the true speeds as priors (as `elasticd start --device-speed` would)
or, with `Learning`, starts knowing nothing and learns them from noisy reports, re-laying running jobs out
through the re-layout gate. What it leaves out: live resizes and re-layouts cost nothing here (in the
system a snapshot and seconds), the flush cost is never learned (reports carry compute only), and every
job has the same priority, so rule 5 (preemption) never fires.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

from elasticd.placement import policy
from elasticd.placement.cost import CostModel, device_key, ring_shape
from elasticd.placement.hysteresis import RelayoutGate
from elasticd.placement.placer import block_sizes, choose, uniform_sizes

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
    work: float = 1.0            # time units per worker-step at speed 1: jobs differ by orders of magnitude


@dataclass(frozen=True, slots=True)
class SimResult:
    jct: dict[str, float]        # job -> completion time (finish - arrival)
    speeds: dict[str, float]     # the speed-aware policy's device speeds at the end ({} for uniform)

    @property
    def mean_jct(self) -> float:
        return sum(self.jct.values()) / len(self.jct)


def make_trace(seed: int, jobs: int = 60, mean_gap: float = 800.0) -> list[SimJob]:
    """Poisson arrivals; N from 1 to 16, elastic down to 1 device or rigid at N/2; 20..400 steps of 0.2, 1
    or 5 units of work per worker-step."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(jobs):
        t += rng.expovariate(1.0 / mean_gap)
        n = rng.choice([1, 2, 4, 4, 8, 8, 12, 16])
        lo, hi = (1, n) if rng.random() < 0.75 else (max(1, n // 2), max(1, n // 2))
        out.append(SimJob(f"j{i:03d}", t, n, lo, hi, rng.randint(20, 400), rng.choice([0.2, 1.0, 5.0])))
    return out


def _step(blocks: list[tuple[str, int]], work: float, speed: dict[str, float], comm_a: float,
          comm_b: float) -> float:
    m = len(blocks)
    flush = 0.0 if m == 1 else comm_a + comm_b * ring_shape(m)
    return max(n * work / speed[d] for d, n in blocks) + flush


@dataclass(slots=True)
class _Run:
    job: SimJob
    devices: list[tuple[str, str]]
    blocks: list[tuple[str, int]]
    step_s: float
    left: float           # steps still to run
    since: float          # when `left` was last brought up to date


@dataclass(frozen=True, slots=True)
class Learning:
    """The speed-aware policy starts knowing nothing and learns from reports every `every` time units,
    each off by up to +-noise/2 and `spike_p` of them 4x too slow (a neighbour's burst)."""

    every: float = 25.0
    noise: float = 0.2
    spike_p: float = 0.05
    seed: int = 0


def simulate(trace: list[SimJob], fleet: tuple[tuple[float, ...], ...], speed_aware: bool,
             learning: Learning | None = None, comm_a: float = 0.05, comm_b: float = 0.2) -> SimResult:
    """Run `trace` on `fleet` (per node, its devices' speeds) under one policy; every job finishes.

    Speed-aware with `learning`: no priors; reports feed the cost model, which places later jobs, and a
    running job is re-laid-out on its devices when the re-layout gate says so. Without: the true speeds
    are given as priors.

    Raises:
        ValueError: if a job could never start on this fleet.
    """
    speed = {device_key(f"n{i}", f"d{j}"): s for i, node in enumerate(fleet) for j, s in enumerate(node)}
    if any(j.min_devices > len(speed) for j in trace):
        raise ValueError("a job needs more devices than the fleet has")
    costs = None if not speed_aware else CostModel() if learning else CostModel(speed)
    gate = RelayoutGate(cooldown_s=4 * learning.every) if learning else None
    noise = random.Random(learning.seed) if learning else None
    tick = learning.every if learning else 25.0   # the same ticks for every policy: same float arithmetic
    pending = sorted(trace, key=lambda j: (j.arrival, j.job_id))
    seq = {j.job_id: i for i, j in enumerate(pending)}
    queued: list[SimJob] = []
    running: dict[str, _Run] = {}
    jct: dict[str, float] = {}
    now, next_tick = 0.0, tick

    def layout(job: SimJob, devs: list[tuple[str, str]]) -> list[tuple[str, int]]:
        keys = [device_key(*d) for d in devs]
        if costs is not None:
            return list(block_sizes(job.workers, keys, costs, job.job_id).blocks)
        return list(zip(keys, uniform_sizes(job.workers, len(keys)), strict=True))

    def run_on(r: _Run, blocks: list[tuple[str, int]]) -> None:
        r.blocks = blocks
        r.step_s = _step(blocks, r.job.work, speed, comm_a, comm_b)

    while pending or queued or running:
        finish = min(((r.since + r.left * r.step_s, r.job.job_id) for r in running.values()), default=None)
        arrive = pending[0].arrival if pending else math.inf
        if finish is not None and finish[0] <= min(arrive, next_tick):
            now = finish[0]
            done = running.pop(finish[1])
            jct[done.job.job_id] = now - done.job.arrival
            if costs is not None:
                costs.forget_job(done.job.job_id)
        elif arrive <= next_tick or (pending and not running):
            now = arrive
            queued.append(pending.pop(0))
            while next_tick <= now:   # an idle island has nothing to report
                next_tick += tick
        elif running:
            now, next_tick = next_tick, next_tick + tick
        else:
            raise ValueError(f"jobs {[j.job_id for j in queued]} can never start on this fleet")
        for r in running.values():   # bring every run up to now before layouts change
            r.left -= (now - r.since) / r.step_s
            r.since = now
        if learning and costs is not None and gate is not None and noise is not None:
            _learn(running, costs, gate, noise, learning, speed, now, run_on)
        views = _views(fleet, {d for r in running.values() for d in r.devices})
        reqs = [policy.JobRequest(j.job_id, j.workers, j.min_devices, j.max_devices, 0, seq[j.job_id])
                for j in queued]
        grants = policy.place_grants(reqs, views, costs)
        for j in [j for j in queued if j.job_id in grants]:
            devs = list(grants[j.job_id].devices)
            running[j.job_id] = r = _Run(j, devs, [], 0.0, j.steps, now)
            run_on(r, layout(j, devs))
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
            r.devices = r.devices + policy.spread(resize.devices - len(r.devices), views, costs, r.job.job_id)
            run_on(r, layout(r.job, r.devices))
            if gate is not None:
                gate.done(r.job.job_id, now)
            views = _views(fleet, {d for x in running.values() for d in x.devices})
    return SimResult(jct, {d: costs.speed(d) for d in speed} if costs is not None else {})


def _learn(running: dict[str, _Run], costs: CostModel, gate: RelayoutGate, noise: random.Random,
           learning: Learning, speed: dict[str, float], now: float, run_on) -> None:
    """Every running job reports; a job whose layout the model now finds >= 10% slower than the best on its
    devices (three checks running, cooled down) is re-laid-out."""
    for job_id in sorted(running):
        r = running[job_id]
        for device, _n in r.blocks:
            spike = 4.0 if noise.random() < learning.spike_p else 1.0
            seconds = r.job.work / speed[device] * (1 + learning.noise * (noise.random() - 0.5)) * spike
            costs.observe_compute(device, seconds, now, job_id)
        best = block_sizes(r.job.workers, [d for d, _ in r.blocks], costs, job_id)
        go, _gain = gate.check(job_id, costs.predict_step(job_id, r.blocks), best, now)
        if go:
            run_on(r, list(best.blocks))
            gate.done(job_id, now)


def _views(fleet: tuple[tuple[float, ...], ...], busy: set[tuple[str, str]]) -> list[policy.NodeView]:
    return [policy.NodeView(f"n{i}", tuple(f"d{j}" for j in range(len(node)) if (f"n{i}", f"d{j}") not in busy),
                            sum(1 for d in busy if d[0] == f"n{i}"), len(node))
            for i, node in enumerate(fleet)]


def compare(seeds: range, fleet: tuple[tuple[float, ...], ...], jobs: int = 60, mean_gap: float = 800.0,
            learning: Learning | None = None) -> tuple[float, float, float]:
    """Mean JCT over the traces of `seeds` (each job weighing the same): uniform, speed-aware given the
    true speeds, speed-aware learning them (`learning`, default `Learning()`)."""
    learning = learning or Learning()
    sums = [0.0, 0.0, 0.0]
    for seed in seeds:
        trace = make_trace(seed, jobs, mean_gap)
        runs = (simulate(trace, fleet, False), simulate(trace, fleet, True), simulate(trace, fleet, True, learning))
        sums = [a + r.mean_jct for a, r in zip(sums, runs, strict=True)]
    return sums[0] / len(seeds), sums[1] / len(seeds), sums[2] / len(seeds)


@dataclass(frozen=True)
class HeuristicGap:
    worst: float        # largest relative excess of the heuristic's predicted step over the exact one
    mean: float
    exact_s: float      # seconds spent in each search, over all cases
    heuristic_s: float


def heuristic_gap(cases: int, noise: float, seed: int) -> HeuristicGap:
    """The heuristic search against the exact one on random jobs with N <= 64 on up to 64 devices of mixed
    speeds (each off by up to +-noise/2, as fitted speeds are) and a random flush cost per M."""
    rng = random.Random(seed)
    gaps, t_exact, t_heur = [], 0.0, 0.0
    for _ in range(cases):
        free = [f"n{i % 4}/{i}" for i in range(rng.randint(2, 64))]
        n = rng.randint(2, 64)
        m = CostModel({d: rng.choice([1.0, 0.5, 1 / 3, 0.9, 0.25]) * (1 + noise * (rng.random() - 0.5))
                       for d in free})
        a, b = rng.random() * 0.5, rng.random() * rng.choice([0.1, 1.0, 4.0])
        for k in range(2, min(n, len(free)) + 1, rng.randint(1, 7)):
            m.observe_comm("j", k, a + b * 2 * (k - 1) / k, 0)
        t0 = time.perf_counter()
        exact = choose(n, free, 1, len(free), m, "j", exact=True)
        t1 = time.perf_counter()
        heur = choose(n, free, 1, len(free), m, "j", exact=False)
        t_exact, t_heur = t_exact + t1 - t0, t_heur + time.perf_counter() - t1
        if heur.exact or not exact.exact:
            raise AssertionError("choose(exact=...) did not run the search it was asked for")
        gaps.append(heur.predicted_s / exact.predicted_s - 1)
    return HeuristicGap(max(gaps), sum(gaps) / len(gaps), t_exact, t_heur)
