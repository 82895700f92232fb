"""Islands: runs of agents with fast links inside and a slow one between, and the two-level sum across them.

A job that spans islands (racks, pods, clusters) should not send its gradients over the slow link from
every agent. The sum over logical ranks goes in two levels instead: inside each island, its agents' pieces
of the rank tree (comm/rank_tree.py) go to the island's leader (its first agent), which adds them up into
the island's own pieces, the maximal subtrees inside the island's block of ranks; only those cross the
slow link, leader to leader; every leader then adds up the top of the tree and sends the sum back inside
its island. The tree is deterministic mode's, so the bits are those of the flat sum whatever the islands,
the layout and where they cut the tree.

An island is a run of consecutive agents, so its ranks are one block. The transfers are point-to-point on
the agents' group under a tag comm/p2p.py never uses (its tag 1 from logical rank 0 to rank 0: a rank
sending to itself, which it refuses); the whole sum counts as one whole-group collective on every agent
(comm/carried_vote.py relies on that count being the same everywhere).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from elasticd.agent.comm.physical import PhysicalGroup
from elasticd.agent.comm.rank_tree import Node, pieces, tree_sum
from elasticd.core.env_names import ISLANDS_VAR
from elasticd.core.layout import Layout


@dataclass(frozen=True, slots=True)
class Islands:
    """Agents per island, in agent order: island i holds the next `sizes[i]` agents."""

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.sizes or any(s < 1 for s in self.sizes):
            raise ValueError(f"islands need at least one agent each, got {list(self.sizes)}")

    @classmethod
    def even(cls, world: int, count: int) -> Islands:
        """`count` islands over `world` agents, as even as they come (the larger ones first); at most one
        island per agent."""
        count = max(1, min(count, world))
        base, extra = divmod(world, count)
        return cls(tuple(base + (1 if i < extra else 0) for i in range(count)))

    @property
    def world(self) -> int:
        return sum(self.sizes)

    def agents(self, island: int) -> range:
        lo = sum(self.sizes[:island])
        return range(lo, lo + self.sizes[island])

    def of(self, agent: int) -> int:
        for i in range(len(self.sizes)):
            if agent in self.agents(i):
                return i
        raise ValueError(f"agent {agent} is not on any of {len(self.sizes)} islands of {self.world} agents")


def emulated_islands(world: int, environ: Mapping[str, str] = os.environ) -> Islands | None:
    """The islands ELASTICD_ISLANDS=K asks for over `world` agents; None when unset, or one island.

    Raises:
        ValueError: K is not a whole number >= 1.
    """
    raw = environ.get(ISLANDS_VAR, "").strip()
    if not raw:
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{ISLANDS_VAR}={raw!r}: expected a number of islands >= 1")
    islands = Islands.even(world, int(raw))
    return islands if len(islands.sizes) > 1 else None


def two_level_sum(phys: PhysicalGroup, layout: Layout, islands: Islands, mine: list[torch.Tensor]
                  ) -> torch.Tensor:
    """The rank tree's sum over all `layout.workers` ranks; `mine`: this agent's pieces, summed, in rank
    order (comm/collectives.py `FlushEnv._sum_by_tree`). Every agent gets the same bits."""
    if islands.world != phys.world or layout.world != phys.world:
        raise ValueError(f"{islands} and {layout} do not describe the {phys.world} agents of the group")
    me, workers = phys.rank, layout.workers
    tag = workers * workers   # see the module docstring
    island = islands.of(me)
    members = islands.agents(island)
    leader = members[0]
    phys.collectives += 1
    if me != leader:
        for t in mine:
            _send(phys, t, leader, tag)
        return phys.recv_(torch.empty_like(mine[0]), leader, tag)
    values: dict[Node, torch.Tensor] = dict(zip(_pieces(layout, me), mine, strict=True))
    for agent in members[1:]:
        for node in _pieces(layout, agent):
            values[node] = phys.recv_(torch.empty_like(mine[0]), agent, tag)
    top_nodes = _island_pieces(layout, islands, island)
    own = [tree_sum(values, node) for node in top_nodes]
    tops: dict[Node, torch.Tensor] = dict(zip(top_nodes, own, strict=True))
    # Pair by pair in the same order on every leader, the lower island's leader sending first: the first
    # pair not yet done always has both its leaders at it, so blocking sends cannot deadlock.
    for other in range(len(islands.sizes)):
        if other == island:
            continue
        peer = islands.agents(other)[0]
        theirs = _island_pieces(layout, islands, other)
        if other > island:
            for t in own:
                _send(phys, t, peer, tag, cross=True)
        for node in theirs:
            tops[node] = phys.recv_(torch.empty_like(mine[0]), peer, tag)
        if other < island:
            for t in own:
                _send(phys, t, peer, tag, cross=True)
    total = tree_sum(tops, (0, workers))
    for agent in members[1:]:
        _send(phys, total, agent, tag)
    return total


def _pieces(layout: Layout, agent: int) -> list[Node]:
    lo = layout.starts[agent]
    return pieces(layout.workers, lo, lo + layout.sizes[agent])


def _island_pieces(layout: Layout, islands: Islands, island: int) -> list[Node]:
    members = islands.agents(island)
    lo = layout.starts[members[0]]
    hi = layout.starts[members[-1]] + layout.sizes[members[-1]]
    return pieces(layout.workers, lo, hi)


def _send(phys: PhysicalGroup, t: torch.Tensor, dst: int, tag: int, cross: bool = False) -> None:
    t = t.contiguous()
    nbytes = t.numel() * t.element_size()
    phys.bytes_reduced += nbytes
    if cross:
        phys.cross_island_bytes += nbytes
        phys.cross_island_messages += 1
    phys.send_(t, dst, tag)
