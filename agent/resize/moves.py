"""Moving a stopped job's state onto a new number of agents.

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
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from elasticd.agent.comm.layout import owner_of
from elasticd.agent.comm.physical import PhysicalGroup
from elasticd.agent.resize.snapshot import AgentSnapshot, GroupSnapshot, WorkerSnapshot, from_bytes, to_bytes

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Move:
    rank: int  # logical rank whose snapshot moves
    src: int   # old agent
    dst: int   # new agent


def plan_moves(workers: int, old: int, new: int) -> list[Move]:
    """Snapshots that change agent, in logical-rank order (every agent walks the same list)."""
    moves = []
    for r in range(workers):
        src, dst = owner_of(workers, old, r), owner_of(workers, new, r)
        if src != dst:
            moves.append(Move(r, src, dst))
    return moves


def plan_relayout(workers: int, old: int, keep: list[int]) -> list[Move]:
    """Snapshots that change agent when the old agents `keep` stay as new agents 0..len(keep)-1, in
    old-group ranks (the group the shrink moves state over), logical-rank order.

    Raises:
        ValueError: `keep` is empty, repeats an agent or names one outside the old group.
    """
    if not keep or len(set(keep)) != len(keep) or not all(0 <= k < old for k in keep):
        raise ValueError(f"cannot keep agents {keep} of {old}")
    moves = []
    for r in range(workers):
        src, dst = owner_of(workers, old, r), keep[owner_of(workers, len(keep), r)]
        if src != dst:
            moves.append(Move(r, src, dst))
    return moves


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


def shrink(phys: PhysicalGroup, snap: AgentSnapshot, workers: int, new_world: int, master_addr: str,
           master_port: int, keep: list[int] | None = None) -> tuple[PhysicalGroup | None, AgentSnapshot]:
    """Over the old group: hand snapshots to the agents that stay (`keep`, in new rank order; default
    the first `new_world`); then re-form with them. The new group's rank of an agent is its place in
    `keep` (`PhysicalGroup.rank`).

    Returns (None, snap) for an agent that leaves.
    """
    me, old = phys.rank, phys.world
    keep = list(range(new_world)) if keep is None else list(keep)
    if len(keep) != new_world:
        raise ValueError(f"a shrink to {new_world} agents cannot keep {keep}")
    got = _exchange(phys, me, plan_relayout(workers, old, keep), snap)
    phys.close()
    if me not in keep:
        return None, snap
    rank = keep.index(me)
    kept = {r: w for r, w in snap.workers.items() if owner_of(workers, new_world, r) == rank}
    new = PhysicalGroup.connect(rank, new_world, phys.device, master_addr, master_port)
    return new, AgentSnapshot(groups=snap.groups, workers={**kept, **got})


def grow(phys: PhysicalGroup | None, snap: AgentSnapshot | None, workers: int, old_world: int, rank: int,
         new_world: int, device: torch.device, master_addr: str, master_port: int
         ) -> tuple[PhysicalGroup, AgentSnapshot]:
    """Form the larger group (old agents and joining ones), then move snapshots over it.

    `phys`/`snap` are None on a joining agent, which receives everything it hosts.
    """
    if phys is not None:
        phys.close()
    new = PhysicalGroup.connect(rank, new_world, device, master_addr, master_port)
    got = _exchange(new, rank, plan_moves(workers, old_world, new_world), snap)
    if rank == 0:
        assert snap is not None
        blob = to_bytes({"groups": [g.to_dict() for g in snap.groups]})
        for joiner in range(old_world, new_world):
            new.send_bytes(blob, joiner)
    if rank >= old_world:
        groups = [GroupSnapshot.from_dict(g) for g in from_bytes(new.recv_bytes(0))["groups"]]
        return new, AgentSnapshot(groups=groups, workers=got)
    assert snap is not None
    kept = {r: w for r, w in snap.workers.items() if owner_of(workers, new_world, r) == rank}
    return new, AgentSnapshot(groups=snap.groups, workers={**kept, **got})
