"""Which logical ranks each physical agent hosts."""

from __future__ import annotations


def hosted_ranks(workers: int, devices: int, agent: int) -> list[int]:
    """Logical ranks hosted by physical agent `agent` of `devices`, as a contiguous block.

    Blocks are contiguous and ordered so that concatenating every agent's hosted tensors in agent order
    gives rank order (all_gather relies on it). When `devices` does not divide `workers`, the first
    `workers % devices` agents host one extra rank.

    Raises:
        ValueError: if the sizes do not describe a valid layout.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if not 1 <= devices <= workers:
        raise ValueError(f"devices must be between 1 and workers={workers}, got {devices}")
    if not 0 <= agent < devices:
        raise ValueError(f"agent index {agent} out of range for {devices} devices")
    base, extra = divmod(workers, devices)
    start = agent * base + min(agent, extra)
    count = base + (1 if agent < extra else 0)
    return list(range(start, start + count))


def owner_of(workers: int, devices: int, rank: int) -> int:
    """The physical agent that hosts logical `rank`."""
    for agent in range(devices):
        ranks = hosted_ranks(workers, devices, agent)
        if ranks[0] <= rank <= ranks[-1]:
            return agent
    raise ValueError(f"logical rank {rank} out of range for {workers} workers")
