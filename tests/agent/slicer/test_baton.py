"""The baton state machine, without threads: hand-off order, flush timing, stranded workers, workers blocked
on point-to-point messages."""

from __future__ import annotations

import pytest

from elasticd.agent.slicer.baton import AllDone, Baton, BatonError, Flush, Idle, Run, Stranded
from elasticd.core.layout import hosted_ranks, owner_of


def test_round_robin_then_flush_then_lowest_rank_again() -> None:
    b = Baton([5, 4, 6])
    assert b.start() == Run(4)
    assert b.arrive(4) == Run(5)
    assert b.arrive(5) == Run(6)
    assert b.arrive(6) == Flush(seq=0, ranks=(4, 5, 6))
    assert b.flushed() == Run(4)
    assert b.arrive(4) == Run(5)
    assert b.arrive(5) == Run(6)
    assert b.arrive(6) == Flush(seq=1, ranks=(4, 5, 6))


def test_single_worker_flushes_at_every_collective() -> None:
    b = Baton([0])
    assert b.start() == Run(0)
    assert b.arrive(0) == Flush(seq=0, ranks=(0,))
    assert b.flushed() == Run(0)
    assert b.finish(0) == AllDone()


def test_all_finish() -> None:
    b = Baton([0, 1])
    b.start()
    assert b.finish(0) == Run(1)
    assert b.finish(1) == AllDone()


def test_worker_returning_while_others_wait_is_stranded() -> None:
    b = Baton([0, 1, 2])
    b.start()
    assert b.arrive(0) == Run(1)
    assert b.finish(1) == Run(2)
    assert b.arrive(2) == Stranded(waiting=(0, 2), seq=0, returned=(1,))


def test_acting_without_the_baton_is_refused() -> None:
    b = Baton([0, 1])
    b.start()
    with pytest.raises(BatonError):
        b.arrive(1)


@pytest.mark.parametrize("n,m", [(8, 1), (8, 2), (8, 3), (7, 4), (4, 4), (5, 2)])
def test_layout_is_contiguous_balanced_and_complete(n: int, m: int) -> None:
    blocks = [hosted_ranks(n, m, p) for p in range(m)]
    assert [r for b in blocks for r in b] == list(range(n))
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
    assert all(owner_of(n, m, r) == p for p, b in enumerate(blocks) for r in b)


@pytest.mark.parametrize("n,m,p", [(4, 5, 0), (4, 0, 0), (0, 1, 0), (4, 2, 2)])
def test_layout_rejects_impossible_sizes(n: int, m: int, p: int) -> None:
    with pytest.raises(ValueError):
        hosted_ranks(n, m, p)


def test_a_blocked_worker_runs_again_after_its_hosted_sender_delivers_and_holds_back_the_flush() -> None:
    b = Baton([0, 1, 2])
    b.start()
    assert b.block(0) == Run(1)          # rank 0 waits for rank 1's message
    b.unblock(0)                         # rank 1 sends it, still holding the baton
    assert b.arrive(1) == Run(2)
    assert b.arrive(2) == Run(0)         # no flush while rank 0 has not reached the collective
    assert b.arrive(0) == Flush(seq=0, ranks=(0, 1, 2))


def test_when_only_blocked_workers_are_left_the_agent_idles_until_one_resumes() -> None:
    b = Baton([0, 1])
    b.start()
    assert b.block(0) == Run(1)
    assert b.arrive(1) == Idle(blocked=(0,))     # rank 1 at a collective, rank 0 waits for another agent
    assert b.holder is None
    assert b.resume(0) == Run(0)
    assert b.arrive(0) == Flush(seq=0, ranks=(0, 1))
    with pytest.raises(BatonError):
        b.resume(1)                              # not blocked, and a holder exists
