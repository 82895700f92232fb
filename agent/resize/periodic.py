"""Periodic snapshots: where a job resumes after a failure, at most one interval behind.

Every `--snapshot-every` steps (or seconds) the agents agree, inside the step-boundary vote, to take one:
each hosted worker copies its own state to host memory at its boundary (the same parts a resize carries),
the last one to arrive adds the replicated state (agent/slicer/boundary.py), and a background thread
writes the parts into the node's snapshot directory (`s<next step>/`, tmpfs) while training goes on.

A new snapshot is taken only when no agent is still writing the previous one (the vote carries "busy"),
so when snapshot S+1 begins, snapshot S is complete on every node: each agent then deletes every other
periodic snapshot, and the root never holds more than the latest complete one and the one being written.
An agent that cannot snapshot (a full tmpfs, an object whose state cannot be saved) votes busy for good:
the job keeps training, says why in its reports, and a failure restarts it from its last complete
snapshot (or from the beginning).

Where the job spans nodes, each agent also copies the parts it wrote to one agent of the next node (its
buddy), over a process group of the writer's own (`PhysicalGroup.side`), so that losing any one node leaves
a complete snapshot on the others. Where the job spans islands, the buddy is the next node on another
island, so that losing a whole island does too.

After a failure the restarted agents pick the newest step whose parts exist on some node of the new
group (`latest_complete`) and restore it through the resize fall-back path (agent/resize/fallback.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

import torch

from elasticd.agent.comm.physical import PeerLost, PhysicalGroup
from elasticd.agent.resize.fallback import save_parts, write_bytes
from elasticd.core.cadence import Every
from elasticd.core.parts import (
    GROUPS,
    describe,
    missing,
    part_name,
    parts_in,
    periodic_dir,
    periodic_steps,
)

log = logging.getLogger(__name__)

FLAG_NONE, FLAG_DUE, FLAG_BUSY = 0, 1, 2   # what an agent votes; the maximum wins, so busy postpones
_CANDIDATES = 8                            # newest periodic steps each agent offers when restoring


class PeriodicSnapshots:
    """One agent's periodic snapshots: when one is due, the pending captures, the background writer."""

    def __init__(self, root: str | os.PathLike[str], every: Every, writes_groups: bool,
                 complete: int | None = None) -> None:
        self.root = Path(root)
        self.every = every
        self.writes_groups = writes_groups    # agent 0 writes the replicated state, once per snapshot
        self.complete = complete              # newest step whose snapshot every agent finished writing
        self.written: int | None = complete   # newest step this agent finished writing
        self.bytes = 0                        # size of this agent's parts of the newest snapshot
        self.error: str | None = None         # why this agent takes no more snapshots
        self.seconds = 0.0                    # how long the last write took (off the training threads)
        self._last = time.monotonic()
        self._pending: dict[int, dict[str, Any]] = {}
        self._thread: threading.Thread | None = None
        self.phys: PhysicalGroup | None = None   # the agents' group now (the agent sets it at every re-forming)
        self._nodes: tuple[int, list[int]] | None = None   # (id of the group, node tag of each agent)

    # -- the vote ---------------------------------------------------------------------------------
    def flag(self, step: int, total: int | None) -> int:
        """This agent's vote at the boundary after `step`."""
        if self.error is not None or self.busy:
            return FLAG_BUSY
        if self.every.off or (total is not None and step + 1 >= total):
            return FLAG_NONE    # after the last step a snapshot would never be used
        if self.every.steps:
            return FLAG_DUE if (step + 1) % self.every.steps == 0 else FLAG_NONE
        return FLAG_DUE if time.monotonic() - self._last >= self.every.seconds else FLAG_NONE

    def voted(self, flag: int) -> None:
        """The agents' combined flag: no one busy means every agent's last write is done."""
        if flag < FLAG_BUSY and self.written is not None:
            self.complete = self.written

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- capture ------------------------------------------------------------------------------
    def add_worker(self, rank: int, part: dict[str, Any]) -> None:
        self._pending[rank] = part

    def fail(self, why: str) -> None:
        if self.error is None:
            self.error = why
            log.warning("periodic snapshots off for this agent: %s", why)
        self._pending = {}

    def submit(self, step: int, groups: dict[str, Any] | None) -> None:
        """Every hosted worker's part is in: write them (and `groups`) in the background as snapshot `step`."""
        workers, self._pending = self._pending, {}
        self._last = time.monotonic()
        if self.error is not None:
            workers, groups = {}, None   # nothing to write, but the copies to other nodes take every agent
        else:
            self._drop_others(step)
        if not self.writes_groups:
            groups = None
        self._thread = threading.Thread(target=self._write, args=(step, workers, groups, self.phys),
                                        name="elasticd-snapshot", daemon=True)
        self._thread.start()

    def _write(self, step: int, workers: dict[int, dict[str, Any]], groups: dict[str, Any] | None,
               phys: PhysicalGroup | None) -> None:
        started = time.monotonic()
        mine: list[int] = []
        size = 0
        try:
            if workers or groups is not None:
                size = save_parts(periodic_dir(self.root, step), workers, groups)
                mine = [*([GROUPS] if groups is not None else []), *sorted(workers)]
        except OSError as e:   # e.g. tmpfs full: training goes on, the reports say snapshots stopped
            self.fail(f"cannot write the snapshot of step {step} under {self.root}: {e}")
        try:
            if phys is not None and phys.world > 1:
                self._copy_to_buddy(phys, step, mine)
        except (PeerLost, OSError, RuntimeError) as e:   # the group is going away (a failure, a resize)
            self.fail(f"cannot copy the snapshot of step {step} to another node: {e}")
            return
        if self.error is None:
            self.bytes, self.written, self.seconds = size, step, time.monotonic() - started

    def _node_tags(self, phys: PhysicalGroup) -> list[int]:
        """Which node each agent of the group is on (agents of a node share a snapshot root)."""
        if self._nodes is None or self._nodes[0] != id(phys):
            where = f"{socket.gethostname()}:{os.path.realpath(self.root)}".encode()
            tag = int.from_bytes(hashlib.sha1(where).digest()[:8], "little", signed=True)
            tags = phys.all_gather(torch.tensor([tag], dtype=torch.int64), side=True)
            self._nodes = (id(phys), [int(t.item()) for t in tags])
        return self._nodes[1]

    def _copy_to_buddy(self, phys: PhysicalGroup, step: int, mine: list[int]) -> None:
        """Every agent sends the parts it wrote to the first agent of the next node (in order of first agents),
        which writes them into its own node's root."""
        tags = self._node_tags(phys)
        firsts = list(dict.fromkeys(tags))
        if len(firsts) < 2:
            return
        first_agent = {t: tags.index(t) for t in firsts}
        islands = [phys.islands.islands.of(first_agent[f]) if phys.islands is not None else 0 for f in firsts]
        buddy = [first_agent[buddy_node(firsts, firsts.index(t), islands)] for t in tags]
        d = periodic_dir(self.root, step)
        me = phys.rank
        # One global order (by sender): the smallest pending transfer has both its agents waiting on it.
        for src in range(phys.world):
            if src == me:
                phys.send_bytes(len(mine).to_bytes(4, "little"), buddy[src], side=True)
                for part in mine:
                    phys.send_bytes(part.to_bytes(4, "little", signed=True), buddy[src], side=True)
                    phys.send_bytes((d / part_name(part)).read_bytes(), buddy[src], side=True)
            elif buddy[src] == me:
                count = int.from_bytes(phys.recv_bytes(src, side=True), "little")
                for _ in range(count):
                    part = int.from_bytes(phys.recv_bytes(src, side=True), "little", signed=True)
                    write_bytes(d, part, phys.recv_bytes(src, side=True))

    def _drop_others(self, step: int) -> None:
        # Every agent is idle here (the vote said so), so all but the complete snapshot is superseded. (What a
        # run before a failure left half-written went when the job restored: `latest_complete`.) An agent
        # that joined in a grow does not know the complete one yet and leaves the clearing to the others.
        # Agents of a node share the root; their rmtree races are harmless.
        if self.complete is None:
            return
        for s in periodic_steps(self.root):
            if s not in (step, self.complete):
                shutil.rmtree(periodic_dir(self.root, s), ignore_errors=True)

    def close(self, timeout_s: float = 120.0) -> None:
        """Wait for the write in flight (before the agent exits or re-forms its group: the copies to other
        nodes use the group). Bounded: a peer that died leaves the copy failing, not hanging, but a stuck
        writer must not keep a finished agent alive."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def info(self) -> dict[str, Any]:
        """What the agent's step reports carry (and `elasticd status` shows)."""
        out: dict[str, Any] = {"snapshot_step": self.complete if self.complete is not None else -1,
                               "snapshot_bytes": self.bytes}
        if self.error is not None:
            out["snapshot_error"] = self.error
        return out


def latest_complete(phys: PhysicalGroup, root: str | os.PathLike[str], workers: int
                    ) -> tuple[int | None, str]:
    """The newest periodic step whose every part is on some agent's node (every agent gets the same answer),
    and, when a newer snapshot is incomplete, what it lacks (for the record)."""
    local = periodic_steps(root)[-_CANDIDATES:]
    offer = torch.full((_CANDIDATES,), -1, dtype=torch.int64)
    offer[: len(local)] = torch.tensor(local, dtype=torch.int64)
    candidates = sorted({int(s) for t in phys.all_gather(offer) for s in t.tolist() if s >= 0}, reverse=True)
    if not candidates:
        return None, ""
    order = [GROUPS, *range(workers)]
    table = torch.zeros(len(candidates), len(order), dtype=torch.int64)
    for i, step in enumerate(candidates):
        have = set(parts_in(periodic_dir(root, step)))
        for j, part in enumerate(order):
            table[i, j] = int(part in have)
    phys.all_reduce_(table)
    chosen, skipped = None, ""
    for i, step in enumerate(candidates):
        have = [part for j, part in enumerate(order) if bool(table[i, j])]
        lack = missing(workers, have)
        if not lack:
            chosen = step
            break
        if not skipped:
            skipped = f"the snapshot of step {step} lacks {describe(lack)} on every node left"
    # Every agent has listed its parts (the all-reduce is behind it): what is not restored would only mix
    # with the parts this run writes under the same step numbers.
    for s in periodic_steps(root):
        if s != chosen:
            shutil.rmtree(periodic_dir(root, s), ignore_errors=True)
    return chosen, skipped


def buddy_node(nodes: list[int], mine: int, islands: list[int]) -> int:
    """The node (`nodes[k]`) that keeps a copy of node `mine`'s parts: the next one in order on another island
    (`islands[k]`: each node's island), or the next one when every node is on one island."""
    n = len(nodes)
    for step in range(1, n):
        k = (mine + step) % n
        if islands[k] != islands[mine]:
            return nodes[k]
    return nodes[(mine + 1) % n]
