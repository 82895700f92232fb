"""The deterministic sum over logical ranks (agent/comm/collectives.py `FlushEnv.sum_over_ranks`) gives the
bits of the rank tree (agent/comm/rank_tree.py) on every number of agents and layout, for tensors big
enough to be summed shard by shard and for small ones, with sizes that do not divide evenly; also in two
levels across islands (agent/comm/islands.py), wherever the islands cut the tree. Real agent processes,
real gloo."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from util import agent_processes

from elasticd.agent.comm.collectives import SHARD_MIN, FlushEnv
from elasticd.agent.comm.islands import Islands, Link, emulated_islands, emulated_link
from elasticd.agent.comm.rank_tree import pieces, tree_sum
from elasticd.core.layout import Layout
from elasticd.ports import free_port

WORKERS = 7
SIZES = [(3, 5), (SHARD_MIN * 3 + 5,), (41, SHARD_MIN // 8 + 1)]   # small, and two sharded (uneven)


def rank_tensor(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    # Values spread over many magnitudes, so that a different order of additions would change bits.
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(shape, generator=g) * torch.logspace(-6, 6, shape[-1])


def _agent(rank: int, world: int, port: int, out: str, blocks: tuple[int, ...], islands: tuple[int, ...]) -> None:
    from elasticd.agent.comm.physical import PhysicalGroup

    phys = PhysicalGroup.connect(rank, world, torch.device("cpu"), "127.0.0.1", port)
    layout = Layout.of(WORKERS, world, blocks)
    env = FlushEnv(phys, WORKERS, deterministic=True, layout=layout, islands=Islands(islands) if islands else None)
    try:
        sums = [env.sum_over_ranks([rank_tensor(r, s) for r in layout.hosted(rank)]) for s in SIZES]
    finally:
        phys.close()
    torch.save({"sums": sums, "cross_bytes": phys.cross_island_bytes, "cross_messages": phys.cross_island_messages,
                "collectives": phys.collectives}, out)


def run_agents(tmp: Path, world: int, blocks: tuple[int, ...], islands: tuple[int, ...] = ()) -> list[dict]:
    port = free_port("127.0.0.1")
    ctx = agent_processes()
    name = f"m{world}-{'_'.join(map(str, blocks))}-{'_'.join(map(str, islands))}"
    procs = [ctx.Process(target=_agent, args=(r, world, port, str(tmp / f"{name}-{r}.pt"), blocks, islands))
             for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0, f"agent exited with {proc.exitcode}"
    return [torch.load(tmp / f"{name}-{r}.pt") for r in range(world)]


def sums_on(tmp: Path, world: int, blocks: tuple[int, ...]) -> list:
    return [got["sums"] for got in run_agents(tmp, world, blocks)]


def tree_order_sum(ranks: range, shape: tuple[int, ...]) -> torch.Tensor:
    """The reference: halve the ranks (the larger half first), sum each half, add the right to the left."""
    if len(ranks) == 1:
        return rank_tensor(ranks[0], shape).clone()
    mid = (len(ranks) + 1) // 2
    return tree_order_sum(ranks[:mid], shape).add_(tree_order_sum(ranks[mid:], shape))


@pytest.mark.parametrize("world, blocks", [(2, ()), (3, ()), (3, (1, 5, 1))])
def test_sum_over_ranks_is_bitwise_the_rank_tree_sum_on_any_layout(tmp_path: Path, world: int,
                                                                  blocks: tuple[int, ...]) -> None:
    want = [tree_order_sum(range(WORKERS), shape) for shape in SIZES]
    in_rank_order = rank_tensor(0, SIZES[1]).clone()
    for r in range(1, WORKERS):
        in_rank_order.add_(rank_tensor(r, SIZES[1]))
    assert not torch.equal(in_rank_order, want[1]), "the data must be order-sensitive for this test to have teeth"
    for agent, got in enumerate(sums_on(tmp_path, world, blocks)):
        for shape, w, g in zip(SIZES, want, got, strict=True):
            assert g.shape == w.shape and torch.equal(g, w), f"agent {agent} of {world}: sum of {shape} differs"


# (world, blocks, islands): islands cutting the tree at a subtree's edge and inside one, an island of one agent
# on either side, three islands with a leader that hosts a single rank.
ISLAND_CASES = [(4, (), (2, 2)), (4, (1, 2, 3, 1), (1, 3)), (3, (3, 1, 3), (2, 1)), (4, (2, 1, 2, 2), (1, 2, 1))]


@pytest.mark.parametrize("world, blocks, islands", ISLAND_CASES)
def test_across_islands_the_sum_is_bitwise_the_flat_one_and_only_the_islands_pieces_cross(
        tmp_path: Path, world: int, blocks: tuple[int, ...], islands: tuple[int, ...]) -> None:
    want = [tree_order_sum(range(WORKERS), shape) for shape in SIZES]
    got = run_agents(tmp_path, world, blocks, islands)
    layout, isl = Layout.of(WORKERS, world, blocks), Islands(islands)
    for agent, g in enumerate(got):
        for shape, w, s in zip(SIZES, want, g["sums"], strict=True):
            assert s.shape == w.shape and torch.equal(s, w), f"agent {agent}, islands {islands}: sum of {shape} differs"
        # One whole-group collective per sum on every agent, as a flat sum counts (comm/carried_vote.py).
        assert g["collectives"] == len(SIZES), g
    tops = []
    for i in range(len(islands)):
        members = isl.agents(i)
        lo, last = layout.starts[members[0]], members[-1]
        tops.append(len(pieces(WORKERS, lo, layout.starts[last] + layout.sizes[last])))
    per_sum = sum(torch.Size(s).numel() * 4 for s in SIZES)
    for agent, g in enumerate(got):
        i = isl.of(agent)
        leader = agent == isl.agents(i)[0]
        # A leader sends its island's pieces to every other leader, and nothing else crosses.
        assert g["cross_messages"] == (tops[i] * (len(islands) - 1) * len(SIZES) if leader else 0), (agent, g)
        assert g["cross_bytes"] == (tops[i] * (len(islands) - 1) * per_sum if leader else 0), (agent, g)


def test_emulated_islands_come_from_the_environment_and_a_bad_count_is_refused() -> None:
    assert emulated_islands(4, {}) is None and emulated_islands(4, {"ELASTICD_ISLANDS": "1"}) is None
    assert emulated_islands(5, {"ELASTICD_ISLANDS": "2"}) == Islands((3, 2))
    assert emulated_islands(2, {"ELASTICD_ISLANDS": "3"}) == Islands((1, 1))   # at most one island per agent
    assert emulated_islands(1, {"ELASTICD_ISLANDS": "2"}) is None
    for bad in ("0", "two", "-1", "1.5", "\u00b2"):
        with pytest.raises(ValueError, match="expected a number of islands >= 1"):
            emulated_islands(4, {"ELASTICD_ISLANDS": bad})
    with pytest.raises(ValueError, match="at least one agent each"):
        Islands((2, 0))
    # agents per island, as an island scheduler gives a job spanning islands
    assert emulated_islands(5, {"ELASTICD_ISLANDS": "3,2"}) == Islands((3, 2))
    with pytest.raises(ValueError, match="islands of 4 agents, but the job has 3"):
        emulated_islands(3, {"ELASTICD_ISLANDS": "2,2"})
    with pytest.raises(ValueError, match="expected a number of islands >= 1, or agents per island"):
        emulated_islands(3, {"ELASTICD_ISLANDS": "2,0"})
    # The emulated link between them: bandwidth and one-way latency, what a message and a ring take.
    link = emulated_link({"ELASTICD_ISLAND_LINK": "800:2"})
    assert link == Link(800.0, 0.002) and emulated_link({}) is None
    assert link.message_s(1e6) == pytest.approx(0.002 + 0.01)
    assert link.all_reduce_s(2_000_000, 2) == pytest.approx(2 * (0.002 + 0.01))
    for bad in ("0", "fast", "100:-1", "inf", "nan", "100:x"):
        with pytest.raises(ValueError, match="expected MBPS"):
            emulated_link({"ELASTICD_ISLAND_LINK": bad})


def test_one_agent_sums_the_same_tree_without_a_group() -> None:
    env = FlushEnv(_NoGroup(), WORKERS, deterministic=True)  # type: ignore[arg-type]
    hosted = [rank_tensor(r, SIZES[1]) for r in range(WORKERS)]
    before = [t.clone() for t in hosted]
    assert torch.equal(env.sum_over_ranks(hosted), tree_order_sum(range(WORKERS), SIZES[1]))
    assert all(torch.equal(a, b) for a, b in zip(hosted, before, strict=True)), "the inputs were changed"


def test_a_sum_given_fewer_tensors_than_the_agent_hosts_is_an_error_not_a_partial_sum() -> None:
    env = FlushEnv(_NoGroup(), WORKERS, deterministic=True)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="3 tensors to a sum over the 7 ranks"):
        env.sum_over_ranks([rank_tensor(r, (4,)) for r in range(3)])


class _NoGroup:
    """M=1 needs no collective: a group that fails any call proves none is made."""
    world, rank = 1, 0

    def __getattr__(self, name: str):
        raise AssertionError(f"one agent called the physical group's {name}")


@pytest.mark.parametrize("workers, world", [(8, 2), (7, 2), (8, 4), (64, 2), (12, 4), (5, 2)])
def test_uniform_blocks_on_two_agents_and_even_powers_of_two_are_whole_subtrees(workers: int, world: int) -> None:
    layout = Layout.of(workers, world)
    for lo, size in zip(layout.starts, layout.sizes, strict=True):
        assert pieces(workers, lo, lo + size) == [(lo, lo + size)]


def test_pieces_cut_a_block_into_subtrees_in_rank_order() -> None:
    # tree over 8: [0,4) [4,8) -> [0,2) [2,4) [4,6) [6,8) -> leaves; the block [1, 7) is cut at every level
    assert pieces(8, 1, 7) == [(1, 2), (2, 4), (4, 6), (6, 7)]
    assert pieces(8, 0, 8) == [(0, 8)]
    with pytest.raises(ValueError):
        pieces(8, 3, 3)
    with pytest.raises(KeyError):
        tree_sum({(0, 4): torch.zeros(1), (5, 8): torch.zeros(1)}, (0, 8))


def test_a_snapshot_copy_goes_to_the_next_node_on_another_island_so_losing_an_island_loses_no_part() -> None:
    from elasticd.agent.resize.periodic import buddy_node

    # nodes 10, 11 on island 0 and 12, 13 on island 1: each island's copies are on the other
    assert [buddy_node([10, 11, 12, 13], k, [0, 0, 1, 1]) for k in range(4)] == [12, 12, 10, 10]
    assert [buddy_node([10, 11, 12], k, [0, 0, 0]) for k in range(3)] == [11, 12, 10]   # one island: a ring
