"""Which logical ranks each physical agent hosts: a layout, as a value.

A layout is a list of contiguous blocks of logical ranks, one per agent in agent order (sizes n_i >= 1,
sum N). Concatenating every agent's hosted tensors in agent order gives rank order, which all_gather and
the deterministic sharded sum rely on; nothing else about the sizes matters to what the job computes, so
a faster device may host more ranks than a slower one (speed-aware placement). On the wire and
in job tables a layout is `blocks: list[int]`; the empty list means the uniform layout of `workers` over
`devices` (the first `workers % devices` agents one extra), so peers and state from before uneven layouts
stay valid.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate


def uniform_sizes(workers: int, devices: int) -> tuple[int, ...]:
    """Block sizes of the uniform layout: the first `workers % devices` agents host one extra rank.

    Raises:
        ValueError: no valid layout has these sizes.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if not 1 <= devices <= workers:
        raise ValueError(f"devices must be between 1 and workers={workers}, got {devices}")
    base, extra = divmod(workers, devices)
    return tuple(base + (1 if a < extra else 0) for a in range(devices))


def blocks_problem(workers: int, devices: int, blocks: Sequence[int]) -> str | None:
    """Why `blocks` is no layout of `workers` ranks over `devices` agents, or None (empty = uniform)."""
    if workers < 1:
        return f"workers must be >= 1, got {workers}"
    if not 1 <= devices <= workers:
        return f"devices must be between 1 and workers={workers}, got {devices}"
    if not blocks:
        return None
    sizes = list(blocks)
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in sizes):
        return f"block sizes must be integers, got {sizes}"
    if len(sizes) != devices:
        return f"{len(sizes)} block sizes {sizes} for {devices} devices: give one size per device"
    if min(sizes) < 1:
        return f"block sizes {sizes}: every device hosts at least one logical worker"
    if sum(sizes) != workers:
        return f"block sizes {sizes} sum to {sum(sizes)}, not the {workers} logical workers"
    return None


@dataclass(frozen=True, slots=True)
class Layout:
    """Contiguous blocks of logical ranks per agent, in agent order (see the module docstring)."""

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.sizes or min(self.sizes) < 1:
            raise ValueError(f"no layout has block sizes {list(self.sizes)}")

    @classmethod
    def of(cls, workers: int, devices: int, blocks: Sequence[int] = ()) -> Layout:
        """The layout of `workers` ranks over `devices` agents with these block sizes (empty: uniform).

        Raises:
            ValueError: the sizes describe no layout (wrong count, a zero, a wrong sum), with the reason.
        """
        problem = blocks_problem(workers, devices, blocks)
        if problem is not None:
            raise ValueError(problem)
        return cls(tuple(blocks) if blocks else uniform_sizes(workers, devices))

    @property
    def workers(self) -> int:
        return sum(self.sizes)

    @property
    def world(self) -> int:
        return len(self.sizes)

    @property
    def starts(self) -> tuple[int, ...]:
        return (0, *accumulate(self.sizes))[:-1]

    @property
    def is_uniform(self) -> bool:
        return self.sizes == uniform_sizes(self.workers, self.world)

    def hosted(self, agent: int) -> list[int]:
        """Logical ranks hosted by physical agent `agent`.

        Raises:
            ValueError: no such agent.
        """
        if not 0 <= agent < len(self.sizes):
            raise ValueError(f"agent index {agent} out of range for {len(self.sizes)} devices")
        start = sum(self.sizes[:agent])
        return list(range(start, start + self.sizes[agent]))

    def owner(self, rank: int) -> int:
        """The physical agent that hosts logical `rank`.

        Raises:
            ValueError: no such rank.
        """
        if not 0 <= rank < self.workers:
            raise ValueError(f"logical rank {rank} out of range for {self.workers} workers")
        return bisect_right(self.starts, rank) - 1

    def wire(self) -> list[int]:
        """The `blocks` list that names this layout on the wire: empty for the uniform one."""
        return [] if self.is_uniform else list(self.sizes)

    def __str__(self) -> str:
        return "/".join(map(str, self.sizes))


def parse_blocks(text: str) -> list[int]:
    """"6,2" -> [6, 2] ("" -> [], the uniform layout).

    Raises:
        ValueError: not a comma-separated list of integers.
    """
    items = [s.strip() for s in text.split(",")] if text.strip() else []
    if not all(s.isdigit() for s in items):
        raise ValueError(f"{text!r} is not a list of block sizes like 6,2")
    return [int(s) for s in items]


def hosted_ranks(workers: int, devices: int, agent: int, blocks: Sequence[int] = ()) -> list[int]:
    """Logical ranks hosted by physical agent `agent` of `devices` (`blocks`: the layout; empty = uniform).

    Raises:
        ValueError: if the sizes do not describe a valid layout.
    """
    return Layout.of(workers, devices, blocks).hosted(agent)


def owner_of(workers: int, devices: int, rank: int, blocks: Sequence[int] = ()) -> int:
    """The physical agent that hosts logical `rank` (`blocks`: the layout; empty = uniform)."""
    return Layout.of(workers, devices, blocks).owner(rank)
