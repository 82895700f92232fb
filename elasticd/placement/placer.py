"""The placer: which devices a job gets and how many logical workers each hosts. Pure functions.

The objective is the predicted step time: max over devices of n_i * c_i (the busiest device ends the step)
plus the flush at that M. Both halves are solved exactly:

* Sizes for a fixed device list. Every device hosts at least one worker; beyond that, the n-th worker on
  device i costs n * c_i, and the step ends with the largest cost taken, so the optimum takes the N - M
  smallest of those costs: a greedy from one worker each, cheapest next worker first. `_optimal_sizes`
  jumps straight to the level of the continuous optimum N / sum(1/c_i) (every cost below it is taken by
  any optimum) and finishes with a heap, so it costs O(M log M), not O(N log M). Among the layouts that
  reach that optimum it keeps the uniform one, else the one that fills the fastest devices first.
* Which devices, for a given M. The flush cost depends on the job and M only, so swapping a chosen device
  for a faster unchosen one never makes the step longer: the M fastest free devices are optimal.

What is left is the search over M. Exact search tries every M in [min, max]: one candidate per M, each
O(M log M) -- "cheap" means at most EXACT_CANDIDATES (64) candidates, which every job with N <= 64 meets.
Beyond that a heuristic tries O(sqrt(N)) seeds -- both ends, the M near the uniform breakpoints ceil(N/k),
the last device before each of the sqrt(N) largest jumps in speed and the one after -- then walks on from
the three best, across flat stretches, at most sqrt(N) steps each way; its gap to the exact answer is
measured in tests/elasticd/placement/test_placement_placer.py and in the README.

Ties (within a relative 1e-9): fewer devices, then today's uniform layout, then devices earlier in `free`.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from elasticd.placement.cost import CostModel, DeviceKey

EXACT_CANDIDATES = 64
_TIE = 1e-9


@dataclass(frozen=True)
class Placement:
    blocks: tuple[tuple[DeviceKey, int], ...]   # in the job's agent order; sizes sum to N, each >= 1
    predicted_s: float                          # predicted step time
    exact: bool                                 # True when found by exact search

    @property
    def devices(self) -> list[DeviceKey]:
        return [d for d, _ in self.blocks]

    @property
    def sizes(self) -> list[int]:
        return [n for _, n in self.blocks]

    def layout(self) -> list[int]:
        """The layout as the wire and the job table carry it: [] for the uniform layout."""
        sizes = self.sizes
        return [] if sizes == uniform_sizes(sum(sizes), len(sizes)) else sizes


def uniform_sizes(workers: int, devices: int) -> list[int]:
    """Today's layout (elasticd/core/layout.py): the first N % M devices host one extra worker."""
    base, extra = divmod(workers, devices)
    return [base + 1] * extra + [base] * (devices - extra)


def _better(a: float, b: float) -> bool:
    """a is shorter than b by more than round-off."""
    return a < b - _TIE * max(abs(b), 1e-30)


def _optimal_sizes(workers: int, costs: list[float]) -> list[int]:
    """Sizes minimising max n_i * c_i with n_i >= 1 and sum n_i = workers (the uniform layout on a tie)."""
    m = len(costs)
    # Every cost k*c_i <= the continuous optimum is taken by any optimum, provided they fit in N; halve
    # the level until the forced single workers fit too.
    level = workers / sum(1.0 / c for c in costs)
    while True:
        sizes = [max(1, math.floor(level / c)) for c in costs]
        if sum(sizes) <= workers:
            break
        level /= 2
    heap = [((n + 1) * c, i) for i, (n, c) in enumerate(zip(sizes, costs, strict=True))]
    heapq.heapify(heap)
    for _ in range(workers - sum(sizes)):
        _, i = heapq.heappop(heap)
        sizes[i] += 1
        heapq.heappush(heap, ((sizes[i] + 1) * costs[i], i))
    uniform = uniform_sizes(workers, m)
    best = max(n * c for n, c in zip(sizes, costs, strict=True))
    if not _better(best, max(n * c for n, c in zip(uniform, costs, strict=True))):
        return uniform
    # Among the layouts with this busiest device, the one doing the least total work: fill the fastest
    # devices up to the optimum first (N=8 on speeds 1, 1/2: 6/2, not the equally long 5/3, whose slow
    # device would be the first to lengthen the step if it slowed further).
    room = [max(1, math.floor(best / c * (1 + _TIE))) for c in costs]
    sizes, left = [1] * m, workers - m
    for i in sorted(range(m), key=lambda i: (costs[i], i)):
        take = min(room[i] - 1, left)
        sizes[i] += take
        left -= take
    assert left == 0, "the optimum's room holds every worker"
    return sizes


def _check(workers: int, devices: list[DeviceKey]) -> None:
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if not devices:
        raise ValueError("no devices to place on")
    if len(devices) > workers:
        raise ValueError(f"{len(devices)} devices for {workers} workers: every device needs one")
    if len(set(devices)) != len(devices):
        raise ValueError(f"a device is listed twice in {devices}")


def block_sizes(workers: int, devices: list[DeviceKey], costs: CostModel, job_id: str) -> Placement:
    """Best sizes for this fixed, ordered device list (minimise max n_i * c_i + comm(M)).

    Raises:
        ValueError: on no devices, more devices than workers, or a device listed twice.
    """
    _check(workers, devices)
    c = costs.estimates(job_id, devices)
    sizes = _optimal_sizes(workers, [c[d] for d in devices])
    blocks = list(zip(devices, sizes, strict=True))
    return Placement(tuple(blocks), costs.predict_step(job_id, blocks), True)


def choose(workers: int, free: list[DeviceKey], min_devices: int, max_devices: int,
           costs: CostModel, job_id: str, exact: bool | None = None) -> Placement:
    """Which of the free devices a job gets and its sizes (exact search while cheap, N <= 64; heuristic beyond).

    The chosen devices keep their order in `free` (the caller's rank order, e.g. grouped by node).
    `exact` forces one search or the other (to measure the heuristic); None picks by candidate count.

    Raises:
        ValueError: on bad bounds, a device listed twice, or fewer free devices than `min_devices`.
    """
    lo, hi = _bounds(workers, free, min_devices, max_devices)
    if exact is None:
        exact = hi - lo + 1 <= EXACT_CANDIDATES
    return _search(workers, free, lo, hi, costs, job_id, exact)


def _bounds(workers: int, free: list[DeviceKey], min_devices: int, max_devices: int) -> tuple[int, int]:
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if not 1 <= min_devices <= max_devices:
        raise ValueError(f"need 1 <= min_devices <= max_devices, got {min_devices}, {max_devices}")
    if len(set(free)) != len(free):
        raise ValueError("a free device is listed twice")
    lo, hi = min_devices, min(max_devices, workers, len(free))
    if lo > hi:
        raise ValueError(f"{min_devices} devices needed for {workers} workers, {len(free)} free")
    return lo, hi


def _search(workers: int, free: list[DeviceKey], lo: int, hi: int, costs: CostModel, job_id: str,
            exact: bool) -> Placement:
    """Best placement over M in [lo, hi], trying every M (exact) or the heuristic's candidates."""
    c = costs.estimates(job_id, free)
    fastest = sorted(range(len(free)), key=lambda i: (c[free[i]], i))
    cache: dict[int, Placement] = {}

    def at(m: int) -> Placement:
        if m not in cache:
            chosen = sorted(fastest[:m])
            devices = [free[i] for i in chosen]
            sizes = _optimal_sizes(workers, [c[d] for d in devices])
            blocks = tuple(zip(devices, sizes, strict=True))
            busiest = max(n * c[d] for d, n in blocks)
            cache[m] = Placement(blocks, busiest + costs.comm_seconds(job_id, m), exact)
        return cache[m]

    if exact:
        return _best(at(m) for m in range(lo, hi + 1))
    # The predicted step over M is a staircase: it drops where the busiest device's load drops (near the
    # uniform breakpoints ceil(N/k)) and rises where the next slower class of devices must take a worker
    # (just past the last device of each speed). Try those, then walk on from the best few, across flat
    # stretches, a bounded number of steps.
    budget = max(4, math.isqrt(workers))
    # Fitted speeds are all distinct: the class boundaries are the `budget` largest jumps in c.
    jumps = sorted(range(len(fastest) - 1), key=lambda i: (-c[free[fastest[i + 1]]] / c[free[fastest[i]]], i))
    classes = [i + 1 for i in jumps[:budget] if c[free[fastest[i + 1]]] > c[free[fastest[i]]]]
    seeds = {lo, hi} | {-(-workers // k) for k in range(1, budget + 1)} | set(range(1, budget + 1))
    seeds |= set(classes) | {m + 1 for m in classes}
    ranked = sorted((at(m) for m in {min(hi, max(lo, m)) for m in seeds}), key=lambda p: p.predicted_s)
    best = _best(ranked)
    for start in ranked[:3]:
        for direction in (-1, 1):
            m, flat = len(start.blocks), 0
            while lo <= m + direction <= hi and flat < budget:
                nxt = at(m + direction)
                if _better(at(m).predicted_s, nxt.predicted_s):
                    break   # worse: the staircase turned
                flat = 0 if _better(nxt.predicted_s, at(m).predicted_s) else flat + 1
                m += direction
                best = _best([best, nxt])
    return best


def _best(placements) -> Placement:
    """The shortest predicted step; ties go to fewer devices, then the uniform layout, then earlier devices."""
    best: Placement | None = None
    for p in placements:
        if best is None or _better(p.predicted_s, best.predicted_s):
            best = p
        elif not _better(best.predicted_s, p.predicted_s) and _tie_key(p) < _tie_key(best):
            best = p
    assert best is not None
    return best


def _tie_key(p: Placement) -> tuple[int, bool]:
    return (len(p.blocks), p.layout() != [])
