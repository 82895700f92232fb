"""The baton: which hosted worker runs next, and when the agent flushes.

A pure state machine (no threads, no torch): the runtime feeds it events and executes the action it
returns. Exactly one hosted worker holds the baton at a time. A worker gives it up only at a
collective (its `seq`-th) or when it returns. When every live worker waits at the same collective the
agent flushes: one physical collective, after which all of them are runnable again and the baton goes
back to the lowest rank, so the order of work inside an agent is always rank order.

    RUNNABLE --arrive--> WAITING --flushed--> RUNNABLE
    RUNNABLE --finish--> DONE
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class WorkerState(str, Enum):
    RUNNABLE = "runnable"
    WAITING = "waiting"
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


Action = Run | Flush | AllDone | Stranded


class BatonError(RuntimeError):
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

    def finish(self, rank: int) -> Action:
        """`rank` (the holder) returned from the user function."""
        self._expect_holder(rank)
        self.state[rank] = WorkerState.DONE
        return self._next_after(rank)

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
        waiting = tuple(r for r in self.order if self.state[r] is WorkerState.WAITING)
        self.holder = None
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
