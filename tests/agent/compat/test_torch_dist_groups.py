"""Subgroups of the logical world: new_group, new_subgroups and the collectives on them.

tests/jobs/torchrun_groups.py makes groups across agents (even and odd ranks on 2 devices), inside agents
(consecutive pairs), an unsorted group of three, and calls the collectives on them between collectives on the
default group; unchanged under real torchrun (4 processes, gloo) and under elasticd on 1 and 2 devices every
rank must see exactly the same values and objects. In-process: a rank outside a group gets torch's answers,
and group reductions are bitwise the same on every layout in deterministic mode.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from util import JOBS, assert_ranks_saw_what_torchrun_showed, cli, torchrun_saw

import elasticd

SCRIPT = JOBS / "torchrun_groups.py"


@pytest.fixture(scope="module")
def torchrun_seen(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return torchrun_saw(tmp_path_factory, SCRIPT)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("devices", [1, 2])
def test_every_collective_on_a_subgroup_gives_what_torchrun_gives(torchrun_seen: list, tmp_path: Path, devices: int) -> None:
    assert "all_reduce.three" in torchrun_seen[0] and "gather.pair" in torchrun_seen[3]
    assert_ranks_saw_what_torchrun_showed(SCRIPT, devices, torchrun_seen, tmp_path)


def test_a_rank_outside_a_group_gets_torchs_answers() -> None:
    got: dict[int, tuple] = {}

    @elasticd.elastic(workers=3)
    def train(ctx):
        g = dist.new_group([0, 2])
        t = torch.tensor([float(ctx.rank + 1)])
        result = dist.all_reduce(t, group=g)   # rank 1: not a member, returns at once
        got[ctx.rank] = (g is dist.GroupMember.NON_GROUP_MEMBER, dist.get_rank(g), dist.get_world_size(g),
                         float(t), result)

    train()
    assert got[1] == (True, -1, -1, 2.0, None), got
    assert got[0] == (False, 0, 2, 4.0, None) and got[2] == (False, 1, 2, 4.0, None), got


def _sums(devices: int, tmp: Path) -> dict[str, torch.Tensor]:
    script = tmp / "sums.py"
    script.write_text(
        "import os, torch, torch.distributed as dist\nimport elasticd\n"
        "@elasticd.elastic(workers=4, deterministic=True)\n"
        "def train(ctx):\n"
        "    g = dist.new_group([0, 1, 3])\n"
        "    t = (torch.rand(1000, generator=torch.Generator().manual_seed(ctx.rank)) * 10 ** (ctx.rank % 3))\n"
        "    dist.all_reduce(t, group=g)\n"
        "    if ctx.rank == 0:\n"
        "        torch.save(t, os.environ['OUT'])\n"
        "if __name__ == '__main__':\n    train()\n")
    out = tmp / f"sum{devices}.pt"
    run = cli("run", "--workers", "4", "--devices", str(devices), str(script), env={"OUT": str(out)}, timeout=240.0)
    assert run.code == 0, run.output
    return torch.load(out)


@pytest.mark.timeout(300)
def test_a_subgroup_reduction_is_bitwise_the_same_on_every_layout(tmp_path: Path) -> None:
    one, two = _sums(1, tmp_path), _sums(2, tmp_path)
    assert torch.equal(one, two)
