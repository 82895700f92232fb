"""The baton: which hosted worker runs next, and when the agent flushes.

A pure state machine (no threads, no torch): the runtime feeds it events and executes the action it
returns. Exactly one hosted worker holds the baton at a time. A worker gives it up at a collective (its
`seq`-th), when it must wait for a point-to-point message (comm/p2p.py), or when it returns. When every
live worker waits at the same collective the agent flushes: one physical collective, after which all of
them are runnable again and the baton goes back to the lowest rank, so the order of work inside an agent
is always rank order. A blocked worker becomes runnable when its message comes: from a hosted sender
(`unblock`, while the sender holds the baton) or from another agent (`resume`, when nobody holds it and
the agent waited for the message: `Idle`).

    RUNNABLE --arrive--> WAITING --flushed--> RUNNABLE
    RUNNABLE --block--> BLOCKED --unblock/resume--> RUNNABLE
    RUNNABLE --finish--> DONE
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from elasticd.core.errors import RuntimeFault


class WorkerState(str, Enum):
    RUNNABLE = "runnable"
    WAITING = "waiting"
    BLOCKED = "blocked"
    DONE = "done"


@dataclass(frozen=True, slots=True)
class Run:
    """Give the baton to `rank`."""

    rank: int


@dataclass(frozen=True, slots=True)
class Flush:
    """Every live worker waits at collective `seq`: run the physical collective for `ranks`."""

    seq: int
    ranks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllDone:
    """Every hosted worker returned."""


@dataclass(frozen=True, slots=True)
class Stranded:
    """Some workers returned while others wait at a collective they can never complete."""

    waiting: tuple[int, ...]
    seq: int
    returned: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Idle:
    """Nobody can run: the `blocked` workers wait for point-to-point messages (the others wait at a collective
    or returned). The runtime waits for a message and `resume`s its receiver."""

    blocked: tuple[int, ...]


Action = Run | Flush | AllDone | Stranded | Idle


class BatonError(RuntimeFault, RuntimeError):
    """An event that the baton's state does not allow (a runtime bug, not a user error)."""


class Baton:
    def __init__(self, ranks: list[int]) -> None:
        if not ranks:
            raise ValueError("an agent must host at least one logical rank")
        self.order: tuple[int, ...] = tuple(sorted(ranks))
        self.state: dict[int, WorkerState] = {r: WorkerState.RUNNABLE for r in self.order}
        self.seq: dict[int, int] = {r: 0 for r in self.order}  # collectives completed per worker
        self.holder: int | None = None
        # Who may take the baton after each rank, in turn: the ranks after it, then the ones before it and itself.
        self._after = {r: self.order[i + 1:] + self.order[: i + 1] for i, r in enumerate(self.order)}

    def start(self) -> Action:
        self.holder = self.order[0]
        return Run(self.holder)

    def arrive(self, rank: int) -> Action:
        """`rank` (the holder) reached its next collective."""
        self._expect_holder(rank)
        self.state[rank] = WorkerState.WAITING
        return self._next_after(rank)

    def block(self, rank: int) -> Action:
        """`rank` (the holder) waits for a point-to-point message."""
        self._expect_holder(rank)
        self.state[rank] = WorkerState.BLOCKED
        return self._next_after(rank)

    def unblock(self, rank: int) -> None:
        """A hosted sender (the holder) delivered what blocked `rank`: it runs when the baton comes to it."""
        if self.state[rank] is WorkerState.BLOCKED:
            self.state[rank] = WorkerState.RUNNABLE

    def resume(self, rank: int) -> Action:
        """While idle: `rank`'s message came from another agent; it takes the baton."""
        if self.holder is not None or self.state[rank] is not WorkerState.BLOCKED:
            raise BatonError(f"rank {rank} resumed while {self.holder} holds the baton or it is {self.state[rank]}")
        self.state[rank] = WorkerState.RUNNABLE
        self.holder = rank
        return Run(rank)

    def finish(self, rank: int) -> Action:
        """`rank` (the holder) returned from the user function."""
        self._expect_holder(rank)
        self.state[rank] = WorkerState.DONE
        return self._next_after(rank)

    def finished(self, rank: int) -> bool:
        """Whether `rank` has returned from the user function (a rank not hosted here has not)."""
        return self.state.get(rank) is WorkerState.DONE

    def flushed(self) -> Action:
        """The physical collective for the waiting workers completed."""
        for r in self.order:
            if self.state[r] is WorkerState.WAITING:
                self.state[r] = WorkerState.RUNNABLE
                self.seq[r] += 1
        live = [r for r in self.order if self.state[r] is not WorkerState.DONE]
        if not live:
            self.holder = None
            return AllDone()
        self.holder = live[0]
        return Run(self.holder)

    def _next_after(self, rank: int) -> Action:
        for r in self._after[rank]:
            if self.state[r] is WorkerState.RUNNABLE:
                self.holder = r
                return Run(r)
        self.holder = None
        blocked = tuple(r for r in self.order if self.state[r] is WorkerState.BLOCKED)
        if blocked:
            return Idle(blocked)
        waiting = tuple(r for r in self.order if self.state[r] is WorkerState.WAITING)
        if not waiting:
            return AllDone()
        done = tuple(r for r in self.order if self.state[r] is WorkerState.DONE)
        seqs = {self.seq[r] for r in waiting}
        if len(seqs) != 1:  # cannot happen: workers only advance past a collective together
            raise BatonError(f"workers wait at different collectives: {dict((r, self.seq[r]) for r in waiting)}")
        if done:
            return Stranded(waiting=waiting, seq=seqs.pop(), returned=done)
        return Flush(seq=seqs.pop(), ranks=waiting)

    def _expect_holder(self, rank: int) -> None:
        if rank != self.holder:
            raise BatonError(f"rank {rank} acted without the baton (holder is {self.holder})")
