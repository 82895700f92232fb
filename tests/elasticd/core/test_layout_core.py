"""Uneven layouts in the pure parts: the layout value, its validation, and the moves of a
resize between any two layouts, re-layouts at the same number of agents and drains included."""

from __future__ import annotations

import itertools

import pytest

from elasticd.agent.resize.moves import plan_moves, plan_relayout
from elasticd.core.layout import Layout, blocks_problem, hosted_ranks, owner_of, parse_blocks
from elasticd.resize_plan import ResizePlan


def compositions(n: int):
    """Every layout of n ranks: every list of sizes >= 1 summing to n."""
    for cuts in itertools.product((False, True), repeat=n - 1):
        sizes, size = [], 1
        for cut in cuts:
            if cut:
                sizes.append(size)
                size = 1
            else:
                size += 1
        yield Layout((*sizes, size))


def test_a_layout_is_contiguous_blocks_in_agent_order():
    lay = Layout.of(8, 2, [6, 2])
    assert lay.hosted(0) == [0, 1, 2, 3, 4, 5] and lay.hosted(1) == [6, 7]
    assert [lay.owner(r) for r in range(8)] == [0] * 6 + [1] * 2
    assert hosted_ranks(8, 2, 1, [1, 7]) == list(range(1, 8)) and owner_of(8, 2, 0, [1, 7]) == 0
    for n in range(1, 9):
        for lay in compositions(n):
            assert [r for a in range(lay.world) for r in lay.hosted(a)] == list(range(n))
            assert all(lay.owner(r) == a for a in range(lay.world) for r in lay.hosted(a))


def test_empty_blocks_are_the_uniform_layout_and_uniform_goes_on_the_wire_as_empty():
    assert Layout.of(8, 3) == Layout.of(8, 3, [3, 3, 2]) == Layout((3, 3, 2))
    assert Layout.of(8, 3).wire() == [] and Layout.of(8, 3, [2, 3, 3]).wire() == [2, 3, 3]
    assert Layout.of(8, 2, [4, 4]).is_uniform and not Layout.of(8, 2, [6, 2]).is_uniform


@pytest.mark.parametrize("blocks, why", [
    ([6, 3], "sum to 9, not the 8"), ([8, 0], "at least one"), ([4, 2, 2], "3 block sizes"), ([8], "1 block size"),
])
def test_bad_blocks_are_refused_with_the_reason(blocks, why):
    assert why in (blocks_problem(8, 2, blocks) or "")
    with pytest.raises(ValueError, match=why):
        Layout.of(8, 2, blocks)


def test_block_sizes_parse_from_text():
    assert parse_blocks("6,2") == [6, 2] and parse_blocks(" 1, 7 ") == [1, 7] and parse_blocks("") == []
    for bad in ("6;2", "6,,2", "a,b", "-1,9"):
        with pytest.raises(ValueError):
            parse_blocks(bad)


def _check(old: Layout, new: Layout, moves, keep: list[int]) -> None:
    """Agent `keep[j]` of the old group ends with exactly new block j; nothing else moves."""
    assert [m.rank for m in moves] == sorted({m.rank for m in moves}), "one move per rank, in rank order"
    for j, me in enumerate(keep):
        kept = {r for r in old.hosted(me) if new.owner(r) == j} if me < old.world else set()
        got = {m.rank for m in moves if m.dst == me}
        assert kept | got == set(new.hosted(j)) and not kept & got, (old, new, keep)
    assert all(m.src == old.owner(m.rank) and m.src != m.dst for m in moves)


def test_any_layout_moves_to_any_other():
    # Every pair of layouts of up to 7 ranks: grows, shrinks, and re-layouts at the same number of agents.
    for n in range(1, 8):
        every = list(compositions(n))
        for old in every:
            for new in every:
                if new.world >= old.world:   # old agent p is new agent p; agents past the old ones join
                    _check(old, new, plan_moves(old, new), list(range(new.world)))
                else:
                    _check(old, new, plan_relayout(old, new, list(range(new.world))), list(range(new.world)))


def test_a_drain_keeps_any_agents_in_any_order_for_any_layouts():
    for n in range(2, 7):
        every = list(compositions(n))
        for old in every:
            for new in (lay for lay in every if lay.world < old.world):
                for keep in itertools.permutations(range(old.world), new.world):
                    _check(old, new, plan_relayout(old, new, list(keep)), list(keep))


def test_relayout_of_8_ranks_from_4_4_to_6_2_moves_ranks_4_and_5_only():
    moves = plan_moves(Layout.of(8, 2), Layout.of(8, 2, [6, 2]))
    assert [(m.rank, m.src, m.dst) for m in moves] == [(4, 1, 0), (5, 1, 0)]
    back = plan_moves(Layout.of(8, 2, [6, 2]), Layout.of(8, 2, [2, 6]))
    assert [(m.rank, m.src, m.dst) for m in back] == [(2, 0, 1), (3, 0, 1), (4, 0, 1), (5, 0, 1)]
    assert plan_moves(Layout.of(8, 2, [6, 2]), Layout.of(8, 2, [6, 2])) == []
    with pytest.raises(ValueError):
        plan_moves(Layout.of(8, 2), Layout.of(6, 2))


def test_a_resize_plan_takes_a_relayout_at_the_same_size_only_when_the_blocks_change():
    kw = dict(epoch=1, why="faster", now=0.0, placement=[["a", "0"], ["a", "1"]], step=3, timeout_s=10.0)
    plan = ResizePlan.begin(src=2, dst=2, blocks=[6, 2], src_blocks=[], **kw)
    assert plan.joiners == [] and plan.leavers == [] and plan.stayers == [0, 1]
    assert plan.blocks == [6, 2] and plan.src_blocks == []
    with pytest.raises(ValueError):
        ResizePlan.begin(src=2, dst=2, blocks=[6, 2], src_blocks=[6, 2], **kw)
    with pytest.raises(ValueError):
        ResizePlan.begin(src=2, dst=2, **kw)
    with pytest.raises(ValueError):
        ResizePlan.begin(src=2, dst=2, blocks=[6, 1, 1], **kw)
    with pytest.raises(ValueError):
        ResizePlan.begin(src=2, dst=2, blocks=[6, 2], keep=[1, 0], **kw)
