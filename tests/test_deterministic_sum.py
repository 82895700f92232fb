"""The deterministic sum over logical ranks (agent/comm/collectives.py `FlushEnv.sum_over_ranks`) gives the same
bits on every number of agents, for tensors big enough to be summed shard by shard and for small ones,
with layouts and sizes that do not divide evenly. Real agent processes, real gloo."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

import pytest
import torch

from elasticd.agent.comm.collectives import SHARD_MIN, FlushEnv
from elasticd.agent.comm.layout import hosted_ranks
from elasticd.ports import free_port

WORKERS = 7
EVEN_WORKERS = 8                    # start_exchange needs every agent to host as many ranks
EXCHANGED = (SHARD_MIN * 4 + 3,)    # sharded on 2 and 4 agents, not evenly
SIZES = [(3, 5), (SHARD_MIN * 3 + 5,), (41, SHARD_MIN // 8 + 1)]   # small, and two sharded (uneven)


def rank_tensor(rank: int, shape: tuple[int, ...]) -> torch.Tensor:
    # Values spread over many magnitudes, so that a different order of additions would change bits.
    g = torch.Generator().manual_seed(1000 + rank)
    return torch.randn(shape, generator=g) * torch.logspace(-6, 6, shape[-1])


def _agent(rank: int, world: int, port: int, out: str) -> None:
    from elasticd.agent.comm.physical import PhysicalGroup

    phys = PhysicalGroup.connect(rank, world, torch.device("cpu"), "127.0.0.1", port)
    env = FlushEnv(phys, WORKERS, deterministic=True)
    try:
        sums = [env.sum_over_ranks([rank_tensor(r, s) for r in hosted_ranks(WORKERS, world, rank)]) for s in SIZES]
    finally:
        phys.close()
    torch.save(sums, out)


def _exchanging_agent(rank: int, world: int, port: int, out: str) -> None:
    """The gradient flush's deterministic sum in deterministic mode: each hosted rank's flat tensor sent
    on its way as it arrives (`start_exchange`), summed at the flush (`sum_exchanged`)."""
    from elasticd.agent.comm.physical import PhysicalGroup

    phys = PhysicalGroup.connect(rank, world, torch.device("cpu"), "127.0.0.1", port)
    env = FlushEnv(phys, EVEN_WORKERS, deterministic=True)
    try:
        ranks = hosted_ranks(EVEN_WORKERS, world, rank)
        started = [env.start_exchange(r, rank_tensor(r, EXCHANGED).reshape(-1)) for r in ranks]
        assert all(ex is not None for ex in started), "an even layout of a sharded size must start early"
        small = env.start_exchange(ranks[0], torch.zeros(world * SHARD_MIN - 1))
        summed = env.sum_exchanged(started)  # type: ignore[arg-type]
    finally:
        phys.close()
    torch.save({"sum": summed, "small_started": small is not None}, out)


def sums_on(tmp: Path, world: int, agent=_agent) -> list:
    port = free_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=agent, args=(r, world, port, str(tmp / f"m{world}-{r}.pt"))) for r in range(world)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0, f"agent exited with {proc.exitcode}"
    return [torch.load(tmp / f"m{world}-{r}.pt") for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_sum_over_ranks_is_bitwise_the_rank_order_sum_on_any_number_of_agents(tmp_path: Path, world: int) -> None:
    want = []
    for shape in SIZES:
        total = rank_tensor(0, shape).clone()
        for r in range(1, WORKERS):
            total.add_(rank_tensor(r, shape))
        want.append(total)
    reordered = rank_tensor(WORKERS - 1, SIZES[1]).clone()
    for r in reversed(range(WORKERS - 1)):
        reordered.add_(rank_tensor(r, SIZES[1]))
    assert not torch.equal(reordered, want[1]), "the data must be order-sensitive for this test to have teeth"
    for agent, got in enumerate(sums_on(tmp_path, world)):
        for shape, w, g in zip(SIZES, want, got, strict=True):
            assert g.shape == w.shape and torch.equal(g, w), f"agent {agent} of {world}: sum of {shape} differs"


@pytest.mark.parametrize("world", [4])
def test_exchanges_started_as_ranks_arrive_sum_to_the_rank_order_sum(tmp_path: Path, world: int) -> None:
    want = rank_tensor(0, EXCHANGED).clone()
    for r in range(1, EVEN_WORKERS):
        want.add_(rank_tensor(r, EXCHANGED))
    for agent, got in enumerate(sums_on(tmp_path, world, _exchanging_agent)):
        assert torch.equal(got["sum"], want), f"agent {agent} of {world}: exchanged sum differs"
        assert not got["small_started"], "a tensor below the shard size is summed at the flush, as before"
