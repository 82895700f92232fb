"""Move planning for a resize (agent/resize/moves.py `plan_moves`): pure, so every layout is checked."""

from __future__ import annotations

import pytest

from elasticd.agent.resize.moves import Move, plan_moves
from elasticd.core.layout import Layout, hosted_ranks, owner_of


def layouts(max_workers: int = 12):
    for n in range(1, max_workers + 1):
        for old in range(1, n + 1):
            for new in range(1, n + 1):
                try:
                    hosted_ranks(n, old, 0), hosted_ranks(n, new, 0)
                except ValueError:
                    continue  # a device count the layout refuses (more agents than ranks to give them)
                yield n, old, new


@pytest.mark.parametrize("n, old, new", list(layouts()))
def test_every_agent_ends_with_exactly_its_new_ranks(n, old, new):
    moves = plan_moves(Layout.of(n, old), Layout.of(n, new))
    assert [m.rank for m in moves] == sorted({m.rank for m in moves}), "one move per rank, in rank order"
    for a in range(new):
        kept = {r for r in hosted_ranks(n, old, a) if owner_of(n, new, r) == a} if a < old else set()
        got = {m.rank for m in moves if m.dst == a}
        assert kept | got == set(hosted_ranks(n, new, a))
        assert not kept & got
    for m in moves:
        assert m.src == owner_of(n, old, m.rank) != m.dst == owner_of(n, new, m.rank)


def test_a_resize_to_the_same_size_moves_nothing():
    assert plan_moves(Layout.of(8, 2), Layout.of(8, 2)) == []


def test_shrinking_8_ranks_from_4_to_2_agents():
    # 4 agents host [0,1] [2,3] [4,5] [6,7]; 2 agents host [0..3] [4..7].
    assert plan_moves(Layout.of(8, 4), Layout.of(8, 2)) == [Move(2, 1, 0), Move(3, 1, 0), Move(4, 2, 1), Move(5, 2, 1), Move(6, 3, 1),
                                  Move(7, 3, 1)]
