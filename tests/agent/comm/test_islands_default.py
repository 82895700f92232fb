"""Default mode across islands (agent/comm/islands.py `IslandGroups`): every all-reduce of the agents' group,
started asynchronously as the gradient buckets start theirs or waited for at once, goes in two levels
and gives the flat all-reduce's result within fp32 round-off, in the order the agents asked. Real agent
processes, real gloo; end to end against real DDP in tests/system/test_equivalence.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from util import agent_processes

from elasticd.ports import free_port

SIZES = [(5,), (3000,), (17, 33)]


def contribution(rank: int, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * rank + i)
    return torch.randn(SIZES[i], generator=g)


def _agent(rank: int, world: int, port: int, islands: str, out: str) -> None:
    os.environ["ELASTICD_ISLANDS"] = islands
    from elasticd.agent.comm.physical import PhysicalGroup

    phys = PhysicalGroup.connect(rank, world, torch.device("cpu"), "127.0.0.1", port)
    try:
        assert phys.islands is not None
        # Three sums under way at once, as a backward's buckets are, then a max waited for at once.
        ts = [contribution(rank, i) for i in range(len(SIZES))]
        works = [phys.all_reduce_start(t) for t in ts]
        for w in works:
            phys.finish(w)
        top = phys.all_reduce_(torch.tensor([float(rank)]), "max")
        got = {"sums": ts, "max": top, "sizes": phys.islands.islands.sizes, "leader": phys.islands.leader,
               "collectives": phys.collectives}
    finally:
        phys.close()
    torch.save(got, out)


@pytest.mark.parametrize("world, islands, sizes", [(4, "2", (2, 2)), (4, "3", (2, 1, 1)), (3, "2", (2, 1))])
def test_all_reduces_across_islands_give_the_flat_sums_in_order(tmp_path: Path, world: int, islands: str,
                                                                sizes: tuple[int, ...]) -> None:
    port = free_port("127.0.0.1")
    ctx = agent_processes()
    outs = [str(tmp_path / f"agent{r}.pt") for r in range(world)]
    procs = [ctx.Process(target=_agent, args=(r, world, port, islands, outs[r])) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0, f"agent exited with {p.exitcode}"
    want = [sum(contribution(r, i) for r in range(world)) for i in range(len(SIZES))]
    leaders = [sum(sizes[:i]) for i in range(len(sizes))]
    for rank, out in enumerate(outs):
        got = torch.load(out)
        assert got["sizes"] == sizes and got["leader"] == max(x for x in leaders if x <= rank)
        for i, (w, g) in enumerate(zip(want, got["sums"], strict=True)):
            assert torch.allclose(g, w, rtol=1e-5, atol=1e-6), f"agent {rank}: sum {i} of {SIZES[i]} differs"
        assert got["max"].item() == world - 1
        assert got["collectives"] == len(SIZES) + 1   # counted as the flat ones are (comm/carried_vote.py)


def test_a_resize_across_islands_sets_the_islands_its_new_group_forms_with():
    from elasticd.agent.comm.islands import adopt, emulated_islands

    env: dict[str, str] = {}
    adopt([], 4, env)
    assert env == {}   # an ordinary resize: the islands stay as they are
    adopt([2, 2], 4, env)
    islands = emulated_islands(4, env)
    assert islands is not None and islands.sizes == (2, 2)
    adopt([4], 4, env)   # one island ("4" alone would mean four even islands)
    assert env == {} and emulated_islands(4, env) is None
    with pytest.raises(ValueError, match="hold 3 agents, the new group has 4"):
        adopt([2, 1], 4, env)
