"""torch.distributed's rooted, all-to-all and object collectives over logical ranks.

tests/jobs/torchrun_collectives.py calls each of them with rank-dependent values and records what every rank
saw; run unchanged under real torchrun (4 processes, gloo) and under elasticd on 1 and 2 devices, every rank
must see exactly the same values and objects. In-process: inside an `@elastic` function too, an unequal
all_to_all (NCCL's form; gloo's takes equal chunks only), received objects that are each rank's own copy,
and two ranks calling different collectives failing with both named.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from util import JOBS, assert_ranks_saw_what_torchrun_showed, torchrun_saw

import elasticd
from elasticd.agent.runtime import WorkerFailed

SCRIPT = JOBS / "torchrun_collectives.py"


@pytest.fixture(scope="module")
def torchrun_seen(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return torchrun_saw(tmp_path_factory, SCRIPT)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("devices", [1, 2])
def test_every_collective_gives_every_rank_what_torchrun_gives_it(torchrun_seen: list, tmp_path: Path,
                                                                   devices: int) -> None:
    assert "reduce.2.sum" in torchrun_seen[2] and "gather_object" in torchrun_seen[3]
    assert_ranks_saw_what_torchrun_showed(SCRIPT, devices, torchrun_seen, tmp_path)


def test_inside_an_elastic_function_objects_are_each_ranks_own_and_unequal_all_to_all_routes() -> None:
    got: dict[int, dict[str, Any]] = {}

    @elasticd.elastic(workers=4, deterministic=True)
    def train(ctx):
        r, n = dist.get_rank(), dist.get_world_size()
        mine: dict[str, Any] = {}
        every: list = [None] * n
        dist.all_gather_object(every, {"r": r, "t": torch.tensor([float(r)])})
        every[(r + 1) % n]["t"].add_(100)     # changes this rank's copy only
        again: list = [None] * n
        dist.all_gather_object(again, every[(r + 1) % n]["t"])
        mine["again"] = [float(t) for t in again]
        outs = [torch.zeros(j + 1) for j in range(n)]       # rank j sends this rank j+1 values
        work = dist.all_to_all(outs, [torch.full((r + 1,), float(10 * r + j)) for j in range(n)], async_op=True)
        work.wait()
        mine["routed"] = [o.tolist() for o in outs]
        t = torch.tensor([float(r + 1)])
        dist.reduce(t, dst=3, op=dist.ReduceOp.PRODUCT)
        mine["product"] = float(t)
        got[r] = mine

    train()
    for r in range(4):
        assert got[r]["again"] == [float((j + 1) % 4) + 100 for j in range(4)], got[r]
        assert got[r]["routed"] == [[float(10 * j + r)] * (j + 1) for j in range(4)], got[r]
        assert got[r]["product"] == (24.0 if r == 3 else float(r + 1)), got[r]


def test_two_ranks_calling_different_collectives_fail_naming_both() -> None:
    @elasticd.elastic(workers=2)
    def train(ctx):
        if ctx.rank == 0:
            dist.gather_object({"a": 1}, [None, None], dst=0)
        else:
            dist.all_gather_object([None, None], {"a": 1})

    with pytest.raises(WorkerFailed) as info:
        train()
    assert "CollectiveMismatch" in info.value.message and "logical ranks 0 and 1" in info.value.message
    assert "gather_object" in info.value.message and "all_gather_object" in info.value.message


def test_a_root_that_is_no_rank_and_a_list_on_the_wrong_rank_are_refused_as_torch_refuses_them() -> None:
    errors: dict[int, list[str]] = {}

    @elasticd.elastic(workers=2)
    def train(ctx):
        errors[ctx.rank] = []
        for call in (lambda: dist.reduce(torch.ones(1), dst=5),
                     lambda: dist.gather(torch.ones(1), [torch.ones(1)] * 2, dst=1 - ctx.rank),
                     lambda: dist.scatter(torch.ones(1), [torch.ones(1)] * 2, src=1 - ctx.rank)):
            try:
                call()
            except ValueError as e:
                errors[ctx.rank].append(str(e))

    train()
    for r in (0, 1):
        assert len(errors[r]) == 3, errors
        assert "dst=5 is not a logical rank of 2" in errors[r][0]
        assert "must NOT be specified on non-destination ranks" in errors[r][1]
        assert "must NOT be specified on non-source ranks" in errors[r][2]
