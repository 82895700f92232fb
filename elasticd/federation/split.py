"""How a job spanning islands is cut into portions: which islands, how many devices each, which ranks.

A pure function of the request and what each island last reported free. Devices go to islands in
proportion to their free devices (largest remainders, at least one each, never more than free); the
job's N logical workers go to its M agents in proportion to the mean speed of their island's free
devices (the uniform layout when the islands are alike), and each island gets the consecutive block of
agents its share names, so portion i's ranks start where portion i-1's end. An island is a run
of consecutive ranks, which is what the two-level sums need (agent/comm/islands.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from elasticd import protocol as p
from elasticd.core.layout import uniform_sizes


@dataclass(frozen=True, slots=True)
class Split:
    islands: tuple[str, ...]
    devices: tuple[int, ...]      # agents per island, in rank order
    blocks: tuple[int, ...]       # logical workers per agent, in rank order

    @property
    def world(self) -> int:
        return sum(self.devices)

    def portion(self, span_id: str, attempt: int, index: int, workers: int) -> p.PortionSpec:
        return p.PortionSpec(span_id=span_id, attempt=attempt, index=index, workers=workers, world=self.world,
                             rank_offset=sum(self.devices[:index]), blocks=list(self.blocks),
                             islands=list(self.devices))


def choose(req: p.SubmitSpanning, free: dict[str, int], partial: bool = False) -> tuple[str, ...] | str:
    """The islands the job goes to (rank order), or why it cannot go now. `free`: islands that are up,
    with their free devices; `partial`: a restart, on those of its islands that are up."""
    if req.islands:
        down = [i for i in req.islands if i not in free]
        if partial and len(down) < len(req.islands):
            return tuple(i for i in req.islands if i in free)
        if down:
            return f"island {', '.join(down)} {'is' if len(down) == 1 else 'are'} not up at the front"
        return tuple(req.islands)
    want = req.devices or req.workers
    ranked = sorted((i for i in free if free[i] > 0), key=lambda i: (-free[i], i))
    limit = req.max_islands or len(ranked)
    chosen: list[str] = []
    for i in ranked[:limit]:
        chosen.append(i)
        if sum(free[c] for c in chosen) >= want:
            break
    if not chosen:
        return "no island has a free device"
    return tuple(chosen)


def split(req: p.SubmitSpanning, free: dict[str, int], partial: bool = False,
          speed: dict[str, float] | None = None) -> Split | str:
    """The portions of `req` over the islands `choose` picks, or why the job must wait. `speed`: each
    island's free devices' speeds added up; the agents of an island whose devices are faster host more
    logical workers (none given, or 0 for an island: the uniform layout's)."""
    islands = choose(req, free, partial)
    if isinstance(islands, str):
        return islands
    have = {i: free[i] for i in islands}
    full = [i for i, n in have.items() if n == 0]
    if full:
        return f"island {', '.join(full)} has no free device"
    total = sum(have.values())
    m = req.devices or min(req.workers, total)
    if m < len(islands):
        return f"{m} devices cannot span {len(islands)} islands (one agent each at least)"
    if total < m:
        shown = ", ".join(f"{i} {n}" for i, n in have.items())
        return f"{m} devices wanted, {total} free on its islands ({shown})"
    sizes = apportion(m, [have[i] for i in islands], caps=[have[i] for i in islands])
    mean = [(speed or {}).get(i, 0.0) / have[i] for i in islands]
    if all(x > 0 for x in mean) and max(mean) > min(mean):
        blocks = apportion(req.workers, [x for x, n in zip(mean, sizes, strict=True) for _ in range(n)])
    else:
        blocks = list(uniform_sizes(req.workers, m))
    return Split(islands=islands, devices=tuple(sizes), blocks=tuple(blocks))


def grown(req: p.SubmitSpanning, parts: list[tuple[str, int]], back: list[str], free: dict[str, int],
          speed: dict[str, float] | None = None) -> Split | str:
    """The running job (`parts`: its islands and their agents, in rank order) grown onto the islands `back`
    live: its agents keep their ranks and devices, each island of `back` that has free devices gets agents
    after them (an island stays a run of consecutive ranks) up to the devices the job asked for, and the N
    workers are laid out over them all again. Or why it cannot grow."""
    room = (req.devices or req.workers) - sum(n for _i, n in parts)
    added: list[tuple[str, int]] = []
    for i in back:
        n = min(free.get(i, 0), room)
        if n >= 1:
            added.append((i, n))
            room -= n
    if not added:
        return "no device to grow onto: it has the devices it asked for, or its islands have none free"
    islands, devices = zip(*parts, *added, strict=True)
    mean = [(speed or {}).get(i, 0.0) / free[i] if free.get(i) else 0.0 for i in islands]
    if all(x > 0 for x in mean) and max(mean) > min(mean):
        blocks = apportion(req.workers, [x for x, n in zip(mean, devices, strict=True) for _ in range(n)])
    else:
        blocks = list(uniform_sizes(req.workers, sum(devices)))
    return Split(islands=tuple(islands), devices=tuple(devices), blocks=tuple(blocks))


def shrunk(req: p.SubmitSpanning, parts: list[tuple[str, int]], keep: list[int]) -> Split:
    """The running job (`parts`: its islands and their agents, in rank order) on its old ranks `keep` (in
    order): each island keeps its agents that stay, an island none of whose agents stays drops out, and
    the N workers are laid out again over the agents left."""
    kept = set(keep)
    islands, devices, lo = [], [], 0
    for island, n in parts:
        if (m := sum(1 for r in range(lo, lo + n) if r in kept)) > 0:
            islands.append(island)
            devices.append(m)
        lo += n
    return Split(islands=tuple(islands), devices=tuple(devices), blocks=tuple(uniform_sizes(req.workers, len(keep))))


def apportion(total: int, weights: list[float], caps: list[int] | None = None) -> list[int]:
    """`total` split in proportion to `weights`: at least one each and at most `caps` (when given), largest
    remainders first, ties to the earlier one. `total` must be at least len(weights) and at most sum(caps)."""
    n = len(weights)
    cap = caps or [total] * n
    exact = [total * w / sum(weights) for w in weights]
    shares = [max(1, min(cap[k], int(x))) for k, x in enumerate(exact)]
    order = sorted(range(n), key=lambda k: (-(exact[k] - int(exact[k])), k))
    while sum(shares) < total:
        k = next(k for k in order + list(range(n)) if shares[k] < cap[k])
        shares[k] += 1
        order = [j for j in order if j != k]
    while sum(shares) > total:   # the at-least-one floor took more than there is
        k = max(range(n), key=lambda j: (shares[j], -j))
        shares[k] -= 1
    return shares
