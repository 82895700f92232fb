"""torch.distributed's rooted, all-to-all and object collectives over logical ranks.

tests/jobs/torchrun_collectives.py calls each of them with rank-dependent values and records what every rank
saw; run unchanged under real torchrun (4 processes, gloo) and under elasticd on 1 and 2 devices, every rank
must see exactly the same values and objects. In-process: inside an `@elastic` function too, an unequal
all_to_all (NCCL's form; gloo's takes equal chunks only), received objects that are each rank's own copy,
and two ranks calling different collectives failing with both named.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from test_torchrun_mode import RUN_TIMEOUT
from util import JOBS, cli

import elasticd
from elasticd.agent.slicer.runtime import WorkerFailed

SCRIPT = JOBS / "torchrun_collectives.py"
RANKS = 4


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return a == b


def seen(out: Path) -> list[dict[str, Any]]:
    sys.path.insert(0, str(JOBS))   # the script's own Report class, pickled in what the ranks saw
    try:
        return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(RANKS)]
    finally:
        sys.path.remove(str(JOBS))


@pytest.fixture(scope="module")
def torchrun_seen(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("torchrun_collectives")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(RANKS),
           str(SCRIPT), str(tmp)]
    run = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert run.returncode == 0, f"torchrun failed:\n{run.stdout}{run.stderr}"
    return seen(tmp)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("devices", [1, 2])
def test_every_collective_gives_every_rank_what_torchrun_gives_it(torchrun_seen: list, tmp_path: Path,
                                                                   devices: int) -> None:
    run = cli("run", "--workers", str(RANKS), "--devices", str(devices), str(SCRIPT), str(tmp_path), cwd=tmp_path,
              timeout=RUN_TIMEOUT)
    assert run.code == 0, run.output
    ours = seen(tmp_path)
    assert "reduce.2.sum" in torchrun_seen[2] and "gather_object" in torchrun_seen[3]
    for r, (want, got) in enumerate(zip(torchrun_seen, ours, strict=True)):
        assert want.keys() == got.keys(), (r, set(want) ^ set(got))
        differ = [k for k in want if not same(want[k], got[k])]
        assert not differ, f"rank {r} saw other values than under torchrun: {[(k, want[k], got[k]) for k in differ]}"


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
