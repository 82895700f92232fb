"""The resize snapshot, kept outside the agents so a resize that fails half-way can fall back to it.

At the step boundary of a resize every agent writes what it holds into the node's snapshot directory
(tmpfs, /dev/shm, when the node has one: host memory, not disk) before any state moves: one file per
logical rank (`w<rank>.pt`) and, from agent 0, the replicated state once (`groups.pt`). If an agent
then dies while the group re-forms, the scheduler has every agent stopped and starts the job again on
the devices it had, with `--restore-epoch`: the new agents read the parts from their node's directory
and trade the ones that are on another node (multi-node jobs), and the job resumes at the step it
stopped at, exactly as after a successful resize. The node daemon deletes an epoch's files once a step
completed after it (then no fall-back to it can be needed) and a job's files when the job is over.

Files are `torch.save` bytes read back with `weights_only=True`, like the snapshots agents send each
other (agent/resize/snapshot.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from elasticd.agent.comm.physical import PhysicalGroup
from elasticd.agent.resize.snapshot import AgentSnapshot, GroupSnapshot, WorkerSnapshot, from_bytes, load_file
from elasticd.core.errors import RuntimeFault
from elasticd.core.layout import Layout
from elasticd.core.parts import GROUPS, describe, epoch_dir, part_name, parts_in


class SnapshotMissing(RuntimeFault, RuntimeError):
    """A part of the snapshot to restore is on no agent's node."""


def write_bytes(d: Path, part: int, data: bytes) -> None:
    """A part received from another node (already `torch.save` bytes), written whole then renamed, like `_write`."""
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = d / part_name(part)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _write(path: Path, obj: dict) -> int:
    # Written whole, then renamed: a reader (the node listing parts, a restoring agent) never sees half a
    # file, and an agent killed mid-write leaves no part that looks saved. torch.save to a path streams
    # to the file itself: saving through an in-memory buffer first was 3x slower.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    try:
        torch.save(obj, str(tmp))
        size = os.path.getsize(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size


def save(root: str | os.PathLike[str], epoch: int, snap: AgentSnapshot, with_groups: bool) -> int:
    """Write this agent's parts of epoch `epoch`'s snapshot; returns the bytes written.

    Raises:
        OSError: the snapshot directory is full or not writable (nothing half-written is left).
    """
    return save_parts(epoch_dir(root, epoch), {r: w.to_dict() for r, w in snap.workers.items()},
                      {"groups": [g.to_dict() for g in snap.groups]} if with_groups else None)


def save_parts(d: Path, workers: dict[int, dict], groups: dict | None) -> int:
    """Write logical ranks' parts (and the replicated state, when given) into snapshot directory `d`.

    Raises:
        OSError: the directory is full or not writable (nothing half-written is left).
    """
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    total = 0
    for rank, w in sorted(workers.items()):
        total += _write(d / part_name(rank), w)
    if groups is not None:
        total += _write(d / part_name(GROUPS), groups)
    return total


def restore(phys: PhysicalGroup, root: str | os.PathLike[str], epoch: int, layout: Layout) -> AgentSnapshot:
    """The snapshot of resize `epoch` (see `restore_dir`)."""
    return restore_dir(phys, epoch_dir(root, epoch), layout, f"resize {epoch}")


def restore_dir(phys: PhysicalGroup, d: Path, layout: Layout, label: str) -> AgentSnapshot:
    """Every agent of the (re-started) job calls this: load the parts of the ranks it hosts in `layout`
    and the replicated state, from its own node's files when they are there, else from the first agent
    that has them. Parts are per logical rank, so any layout restores a snapshot saved under any other.
    Parts load onto the CPU whatever the agent's device (see `snapshot.from_bytes`).

    Raises:
        SnapshotMissing: a part is on no agent's node (on every agent alike: they all see the same table).
    """
    me, world, workers = phys.rank, phys.world, layout.workers
    if layout.world != world:
        raise ValueError(f"layout {layout} is not of this group's {world} agents")
    local = set(parts_in(d))
    order = [GROUPS, *range(workers)]
    # Who has what, everywhere: a row per agent, all-reduced into the same table on every agent.
    table = torch.zeros(world, len(order), dtype=torch.int64)
    for i, part in enumerate(order):
        table[me, i] = int(part in local)
    table = phys.all_reduce_(table)   # a CPU tensor: the group carries those on every device (physical.py)
    lost = [part for i, part in enumerate(order) if not bool(table[:, i].any())]
    if lost:
        raise SnapshotMissing(f"snapshot of {label} lacks {describe(lost)}: saved on no node of the job")
    mine = set(layout.hosted(me))
    got: dict[int, bytes] = {}
    # One global order of transfers (by part, then receiving agent): the smallest pending transfer always
    # has both its agents waiting on it, so this never deadlocks (as in agent/resize/moves.py).
    for i, part in enumerate(order):
        src = int(table[:, i].nonzero()[0])
        for dst in range(world):
            needs = part == GROUPS or dst == layout.owner(part)
            if not needs or bool(table[dst, i]):
                continue
            if me == src:
                phys.send_bytes((d / part_name(part)).read_bytes(), dst)
            elif me == dst:
                got[part] = phys.recv_bytes(src)

    def load(part: int) -> dict:
        if part in got:
            return from_bytes(got[part])
        return load_file(d / part_name(part))

    groups = [GroupSnapshot.from_dict(g) for g in load(GROUPS)["groups"]]
    return AgentSnapshot(groups=groups, workers={r: WorkerSnapshot.from_dict(load(r)) for r in sorted(mine)})
