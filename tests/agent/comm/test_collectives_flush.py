"""Each logical collective's flush (agent/comm/collectives.py) on one agent hosting every rank.

The multi-agent path is covered by the equivalence and deterministic tests with real agent processes;
here the local half of each op is checked on its own: what the hosted workers get back.
"""

from __future__ import annotations

import pytest
import torch

from elasticd.agent.comm.collectives import (
    AllGather,
    AllReduce,
    Barrier,
    Broadcast,
    CollectiveMismatch,
    FlushEnv,
    ReduceScatter,
    check_matching,
)
from elasticd.agent.comm.physical import PhysicalGroup

N = 4


def env(deterministic: bool = False) -> FlushEnv:
    return FlushEnv(PhysicalGroup(0, 1, torch.device("cpu")), N, deterministic)


def rank_tensors(shape=(3,)) -> list[torch.Tensor]:
    return [torch.full(shape, float(r + 1)) * torch.tensor([1.0, 10.0, 100.0]) for r in range(N)]


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("op, want", [("sum", [10.0, 100.0, 1000.0]), ("avg", [2.5, 25.0, 250.0]),
                                      ("max", [4.0, 40.0, 400.0]), ("min", [1.0, 10.0, 100.0]),
                                      ("product", [24.0, 240000.0, 2.4e9])])
def test_all_reduce_gives_every_rank_the_reduction(op, want, deterministic):
    ts = rank_tensors()
    AllReduce.flush([AllReduce(r, tensor=t, reduce_op=op) for r, t in enumerate(ts)], env(deterministic))
    for t in ts:
        assert torch.allclose(t, torch.tensor(want), rtol=1e-6)


def test_broadcast_copies_the_source_rank_to_the_others():
    ts = rank_tensors()
    Broadcast.flush([Broadcast(r, tensor=t, src=2) for r, t in enumerate(ts)], env())
    for t in ts:
        assert torch.equal(t, torch.tensor([3.0, 30.0, 300.0]))


def test_all_gather_hands_every_rank_its_own_copy_in_rank_order():
    ts = rank_tensors()
    ops = [AllGather(r, tensor=t) for r, t in enumerate(ts)]
    AllGather.flush(ops, env())
    for o in ops:
        assert [x[0].item() for x in o.result] == [1.0, 2.0, 3.0, 4.0]
    ops[0].result[1].zero_()
    assert ops[1].result[1][0].item() == 2.0, "results must not share memory between ranks"


def test_reduce_scatter_leaves_each_rank_its_row_of_the_sum():
    inputs = [torch.arange(N * 2, dtype=torch.float32).view(N, 2) * (r + 1) for r in range(N)]
    outs = [torch.zeros(2) for _ in range(N)]
    ops = [ReduceScatter(r, output=o, inputs=i.clone()) for r, (o, i) in enumerate(zip(outs, inputs, strict=True))]
    ReduceScatter.flush(ops, env())
    total = sum(inputs)
    for r, o in enumerate(outs):
        assert torch.equal(o, total[r])


def test_barrier_flushes_without_data():
    Barrier.flush([Barrier(r) for r in range(N)], env())


def test_mismatched_collectives_name_both_ranks():
    ops = [AllReduce(0, tensor=torch.zeros(3)), AllReduce(1, tensor=torch.zeros(4))]
    with pytest.raises(CollectiveMismatch, match="logical ranks 0 and 1"):
        check_matching(ops)
    with pytest.raises(CollectiveMismatch, match="different collectives"):
        check_matching([AllReduce(0, tensor=torch.zeros(3)), Barrier(1)])
