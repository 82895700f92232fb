"""Islands: runs of agents with fast links inside and a slow one between, and the two-level sums across them.

A job that spans islands (racks, pods, clusters) should not send its gradients over the slow link from
every agent. Its sums go in two levels instead.

Deterministic mode (`two_level_sum`): inside each island, its agents' pieces of the rank tree
(comm/rank_tree.py) go to the island's leader (its first agent), which adds them up into the island's own
pieces, the maximal subtrees inside the island's block of ranks; only those cross the slow link, leader
to leader; every leader then adds up the top of the tree and sends the sum back inside its island. The
tree is deterministic mode's, so the bits are those of the flat sum whatever the islands, the layout and
where they cut the tree.

Default mode (`IslandGroups`): an all-reduce is a reduce to the island's leader over the island's own
process group, an all-reduce among the leaders over theirs, and a broadcast back inside the island. The
three run one after another on a thread of the group's own, for every all-reduce of the agent in the
order it asked for them (the same on every agent, as each group's collectives must be), so a gradient
bucket's sum still overlaps the rest of the backward pass.

A slow link between islands can be emulated (`ELASTICD_ISLAND_LINK=MBPS[:MS]`, `Link`): the leaders wait,
after each exchange between islands, for the time that many bytes would take at that bandwidth and
one-way latency. Only what crosses between leaders is delayed; loopback carries it all the same.

An island is a run of consecutive agents, so its ranks are one block. The transfers are point-to-point on
the agents' group under a tag comm/p2p.py never uses (its tag 1 from logical rank 0 to rank 0: a rank
sending to itself, which it refuses); the whole sum counts as one whole-group collective on every agent
(comm/carried_vote.py relies on that count being the same everywhere).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Mapping, MutableMapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.distributed_c10d as dist  # unpatched, as comm/physical.py

from elasticd.agent.comm.rank_tree import Node, pieces, tree_sum
from elasticd.core.env_names import ISLAND_LINK_VAR, ISLANDS_VAR
from elasticd.core.layout import Layout

if TYPE_CHECKING:
    from elasticd.agent.comm.physical import PhysicalGroup


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


@dataclass(frozen=True, slots=True)
class Link:
    """An emulated link between islands: `mbps` megabits a second, `latency_s` one way."""

    mbps: float
    latency_s: float = 0.0

    def message_s(self, nbytes: float) -> float:
        return self.latency_s + nbytes * 8 / (self.mbps * 1e6)

    def all_reduce_s(self, nbytes: int, leaders: int) -> float:
        """A ring all-reduce among `leaders`: 2(L-1) steps, each moving 1/L of the bytes over the link."""
        return 2 * (leaders - 1) * self.message_s(nbytes / leaders)


def emulated_link(environ: Mapping[str, str] = os.environ) -> Link | None:
    """The link ELASTICD_ISLAND_LINK=MBPS[:MS] asks for; None when unset.

    Raises:
        ValueError: not a bandwidth > 0 and an optional latency >= 0 in milliseconds.
    """
    raw = environ.get(ISLAND_LINK_VAR, "").strip()
    if not raw:
        return None
    bw, _, ms = raw.partition(":")
    try:
        link = Link(float(bw), float(ms or 0) / 1000)
    except ValueError:
        link = None
    if link is None or not link.mbps > 0 or not link.latency_s >= 0 or link.mbps == float("inf"):
        raise ValueError(f"{ISLAND_LINK_VAR}={raw!r}: expected MBPS[:MS], a bandwidth > 0 in megabits a "
                         f"second and a one-way latency >= 0 in milliseconds, e.g. 1000:2")
    return link


def emulated_islands(world: int, environ: Mapping[str, str] = os.environ) -> Islands | None:
    """The islands ELASTICD_ISLANDS asks for over `world` agents; None when unset, or one island. K: that many
    islands, as even as they come (emulated); S1,S2,...: islands of those many agents in rank order (what
    an island scheduler gives the agents of a job spanning islands).

    Raises:
        ValueError: not a whole number >= 1, or sizes >= 1 that do not add up to `world`.
    """
    raw = environ.get(ISLANDS_VAR, "").strip()
    if not raw:
        return None
    parts = raw.split(",")
    if not all(s.isascii() and s.isdigit() and int(s) >= 1 for s in parts):
        raise ValueError(f"{ISLANDS_VAR}={raw!r}: expected a number of islands >= 1, or agents per island "
                         "(S1,S2,..., each >= 1)")
    if len(parts) == 1:
        islands = Islands.even(world, int(raw))
    else:
        islands = Islands(tuple(int(s) for s in parts))
        if islands.world != world:
            raise ValueError(f"{ISLANDS_VAR}={raw!r}: islands of {islands.world} agents, but the job has {world}")
    return islands if len(islands.sizes) > 1 else None


def adopt(sizes: list[int], world: int, environ: MutableMapping[str, str] = os.environ) -> None:
    """A resize of a job spanning islands names the new group's islands (`sizes`, agents per island in rank
    order; empty: as they are): set before the group re-forms, which reads them (`emulated_islands`), and
    kept for the groups it forms later.

    Raises:
        ValueError: sizes that do not cut `world` agents into islands of at least one.
    """
    if not sizes:
        return
    islands = Islands(tuple(sizes))
    if islands.world != world:
        raise ValueError(f"islands {list(sizes)} hold {islands.world} agents, the new group has {world}")
    if len(sizes) == 1:
        environ.pop(ISLANDS_VAR, None)   # one number alone would mean that many even islands
    else:
        environ[ISLANDS_VAR] = ",".join(map(str, sizes))


class IslandGroups:
    """The process groups of the agents' islands and of their leaders, and the thread that runs the agent's
    two-level all-reduces in order. Made right after the agents' group, by every agent alike (torch
    requires every member of the job to enter each `new_group`, in the same order)."""

    def __init__(self, islands: Islands, rank: int) -> None:
        self.islands = islands
        island = islands.of(rank)
        self.leader = islands.agents(island)[0]
        self.is_leader = rank == self.leader
        own = [dist.new_group(list(islands.agents(i))) for i in range(len(islands.sizes))]
        self.local = own[island]
        self.leaders = dist.new_group([islands.agents(i)[0] for i in range(len(islands.sizes))])
        self.link = emulated_link()
        self._todo: queue.SimpleQueue[tuple[torch.Tensor, Any, Future[torch.Tensor]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="elasticd-islands", daemon=True)
        self._thread.start()

    def all_reduce(self, t: torch.Tensor, op: Any) -> Future[torch.Tensor]:
        """Start the two-level all-reduce of `t` (in place) after those started before it."""
        done: Future[torch.Tensor] = Future()
        self._todo.put((t, op, done))
        return done

    def close(self) -> None:
        """After the last all-reduce, ended or failed; briefly otherwise (one stuck on a peer that hangs
        ends when the group is destroyed, and the agent must not wait for it to exit or re-form)."""
        self._todo.put(None)
        self._thread.join(timeout=2.0)

    def _serve(self) -> None:
        while (item := self._todo.get()) is not None:
            t, op, done = item
            try:
                dist.reduce(t, self.leader, op=op, group=self.local)
                if self.is_leader:
                    dist.all_reduce(t, op=op, group=self.leaders)
                    if self.link is not None:
                        time.sleep(self.link.all_reduce_s(t.numel() * t.element_size(), len(self.islands.sizes)))
                dist.broadcast(t, self.leader, group=self.local)
            except BaseException as e:  # noqa: BLE001 - the caller's wait raises it (comm/physical.py)
                done.set_exception(e)
                continue
            done.set_result(t)


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
        link = phys.islands.link if phys.islands is not None else None
        if link is not None:
            time.sleep(link.message_s(nbytes))
    phys.send_(t, dst, tag)
