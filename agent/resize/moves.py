"""Moving a stopped job's state onto a new number of agents.

Staying agents keep their process and their copy of the replicated state; only what changes owner
moves, point to point: a logical rank's own snapshot goes from its old agent to its new one, and
agents that join get the replicated state from agent 0. Shrinking moves state over the old group
(every new owner is an old agent) and then re-forms a smaller one; growing forms the new group first
(every old owner is in it) and moves state over it.
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
           master_port: int) -> tuple[PhysicalGroup | None, AgentSnapshot]:
    """Over the old group: hand snapshots to the surviving agents; then re-form with `new_world`.

    Returns (None, snap) for an agent that leaves.
    """
    me, old = phys.rank, phys.world
    got = _exchange(phys, me, plan_moves(workers, old, new_world), snap)
    phys.close()
    if me >= new_world:
        return None, snap
    kept = {r: w for r, w in snap.workers.items() if owner_of(workers, new_world, r) == me}
    new = PhysicalGroup.connect(me, new_world, phys.device, master_addr, master_port)
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
