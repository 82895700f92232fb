"""Moving a stopped job's state onto a new layout: another number of agents, or other block sizes.

Staying agents keep their process and their copy of the replicated state; only what changes owner
moves, point to point: a logical rank's own snapshot goes from its old agent to its new one, and
agents that join get the replicated state from agent 0. Shrinking moves state over the old group
(every new owner is an old agent) and then re-forms a smaller one; growing forms the new group first
(every old owner is in it) and moves state over it.

A shrink keeps any subset of the old agents, in any order (`keep`: the old physical ranks that stay,
listed in their new rank order): an ordinary shrink keeps 0..M2-1, a drain keeps the agents that are
not on the node going away, so old agent 0 may leave and old agent 2 become new agent 0. Every stayer
already holds the replicated state (data parallelism: it is the same on every agent), so only the
logical ranks' own snapshots move.

A layout may also change at the same number of agents (other block sizes: speed-aware placement moves
ranks from a slow device to a fast one): the group stays as it is and the snapshots move over it
(`relayout`). Every function here takes the old and new `Layout`, so any layout goes to any other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from elasticd.agent.comm.physical import PhysicalGroup
from elasticd.agent.resize.snapshot import AgentSnapshot, GroupSnapshot, WorkerSnapshot, from_bytes, to_bytes
from elasticd.core.layout import Layout

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Move:
    rank: int  # logical rank whose snapshot moves
    src: int   # old agent
    dst: int   # new agent


def plan_moves(old: Layout, new: Layout) -> list[Move]:
    """Snapshots that change agent when old agent p is new agent p (a grow, or the same agents with
    other block sizes), in logical-rank order (every agent walks the same list).

    Raises:
        ValueError: the layouts are of different numbers of logical ranks.
    """
    _same_workers(old, new)
    moves = []
    for r in range(old.workers):
        src, dst = old.owner(r), new.owner(r)
        if src != dst:
            moves.append(Move(r, src, dst))
    return moves


def plan_relayout(old: Layout, new: Layout, keep: list[int]) -> list[Move]:
    """Snapshots that change agent when the old agents `keep` stay as new agents 0..len(keep)-1, in
    old-group ranks (the group the shrink moves state over), logical-rank order.

    Raises:
        ValueError: `keep` is empty, repeats an agent, names one outside the old group, or does not
            match the new layout's number of agents.
    """
    _same_workers(old, new)
    if not keep or len(set(keep)) != len(keep) or not all(0 <= k < old.world for k in keep):
        raise ValueError(f"cannot keep agents {keep} of {old.world}")
    if len(keep) != new.world:
        raise ValueError(f"a layout of {new.world} agents cannot keep {keep}")
    moves = []
    for r in range(old.workers):
        src, dst = old.owner(r), keep[new.owner(r)]
        if src != dst:
            moves.append(Move(r, src, dst))
    return moves


def _same_workers(old: Layout, new: Layout) -> None:
    if old.workers != new.workers:
        raise ValueError(f"layouts {old} and {new} are of different numbers of logical workers")


def _exchange(phys: PhysicalGroup, me: int, moves: list[Move], snap: AgentSnapshot | None
              ) -> dict[int, WorkerSnapshot]:
    """Send the snapshots `me` gives away, receive those it gets. Walking the moves in one global order
    never deadlocks: the smallest pending move always has both its agents waiting on it."""
    got: dict[int, WorkerSnapshot] = {}
    for mv in moves:
        if mv.src == me:
            assert snap is not None
            phys.send_bytes(to_bytes(snap.workers[mv.rank].to_dict()), mv.dst)
        elif mv.dst == me:
            got[mv.rank] = WorkerSnapshot.from_dict(from_bytes(phys.recv_bytes(mv.src)))
    return got


def shrink(phys: PhysicalGroup, snap: AgentSnapshot, old: Layout, new: Layout, master_addr: str,
           master_port: int, keep: list[int] | None = None) -> tuple[PhysicalGroup | None, AgentSnapshot]:
    """Over the old group: hand snapshots to the agents that stay (`keep`, in new rank order; default
    the first `new.world`); then re-form with them. The new group's rank of an agent is its place in
    `keep` (`PhysicalGroup.rank`).

    Returns (None, snap) for an agent that leaves.
    """
    me = phys.rank
    keep = list(range(new.world)) if keep is None else list(keep)
    got = _exchange(phys, me, plan_relayout(old, new, keep), snap)
    phys.close()
    if me not in keep:
        return None, snap
    rank = keep.index(me)
    kept = {r: w for r, w in snap.workers.items() if new.owner(r) == rank}
    grp = PhysicalGroup.connect(rank, new.world, phys.device, master_addr, master_port)
    return grp, AgentSnapshot(groups=snap.groups, workers={**kept, **got})


def relayout(phys: PhysicalGroup, snap: AgentSnapshot, old: Layout, new: Layout) -> AgentSnapshot:
    """The same agents, other block sizes: move the snapshots that change owner over the group as it
    is (no re-forming: every agent keeps its rank and its copy of the replicated state).

    Raises:
        ValueError: the layouts are not of this group's number of agents.
    """
    if not old.world == new.world == phys.world:
        raise ValueError(f"a re-layout of {phys.world} agents cannot go from {old} to {new}")
    me = phys.rank
    got = _exchange(phys, me, plan_moves(old, new), snap)
    kept = {r: w for r, w in snap.workers.items() if new.owner(r) == me}
    return AgentSnapshot(groups=snap.groups, workers={**kept, **got})


def grow(phys: PhysicalGroup | None, snap: AgentSnapshot | None, old: Layout | None, rank: int,
         new: Layout | None, device: torch.device, master_addr: str, master_port: int, world: int = 0
         ) -> tuple[PhysicalGroup, AgentSnapshot, Layout]:
    """Form the larger group (old agents and joining ones), then move snapshots over it.

    `phys`/`snap`/`old` are None on a joining agent, which receives everything it hosts, and learns both
    layouts from agent 0 (`world`: the size of the group it joins): the old agents have the resize
    command, a joiner started or woken before the layout was decided need not know it. Returns the new
    group, this agent's snapshot and the new layout.
    """
    if phys is not None:
        phys.close()
    size = new.world if new is not None else world
    grp = PhysicalGroup.connect(rank, size, device, master_addr, master_port)
    old_world = old.world if old is not None else 0
    if rank == 0:
        assert old is not None and new is not None
        said = to_bytes({"old": list(old.sizes), "new": list(new.sizes)})
        for joiner in range(old.world, new.world):
            grp.send_bytes(said, joiner)
    elif old is None:
        told = from_bytes(grp.recv_bytes(0))
        old, new = Layout(tuple(told["old"])), Layout(tuple(told["new"]))
        old_world = 0
    assert old is not None and new is not None
    got = _exchange(grp, rank, plan_moves(old, new), snap)
    if rank == 0:
        assert snap is not None
        blob = to_bytes({"groups": [g.to_dict() for g in snap.groups]})
        for joiner in range(old.world, new.world):
            grp.send_bytes(blob, joiner)
    if old_world == 0:
        groups = [GroupSnapshot.from_dict(g) for g in from_bytes(grp.recv_bytes(0))["groups"]]
        return grp, AgentSnapshot(groups=groups, workers=got), new
    assert snap is not None
    kept = {r: w for r, w in snap.workers.items() if new.owner(r) == rank}
    return grp, AgentSnapshot(groups=snap.groups, workers={**kept, **got}), new
