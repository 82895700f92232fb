"""Point-to-point messages between logical ranks.

tests/jobs/torchrun_p2p.py makes the exchanges scripts make (rings, a pipeline forward and back with
isend/irecv, batch_isend_irecv, tags received out of order, objects), unchanged under real torchrun (4
processes, gloo) and under elasticd on 1 device (every exchange inside one agent, by hand-overs) and on 2
(half of them across agents): every rank must receive exactly what it receives under torchrun. In-process:
an exchange that deadlocks under torchrun fails naming who waits for whom; a receive without a source is
refused by name. Through `elasticd run`: a resize while a message is in flight is refused, naming it, and
the job trains on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from util import JOBS, assert_ranks_saw_what_torchrun_showed, cli, torchrun_saw

import elasticd
from elasticd.agent.runtime import WorkerFailed

SCRIPT = JOBS / "torchrun_p2p.py"


@pytest.fixture(scope="module")
def torchrun_seen(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return torchrun_saw(tmp_path_factory, SCRIPT)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("devices", [1, 2])
def test_every_exchange_delivers_what_torchrun_delivers(torchrun_seen: list, tmp_path: Path, devices: int) -> None:
    assert "objects" in torchrun_seen[2] and "tags" in torchrun_seen[1]
    assert_ranks_saw_what_torchrun_showed(SCRIPT, devices, torchrun_seen, tmp_path)


def test_an_exchange_that_deadlocks_under_torchrun_fails_naming_who_waits_for_whom() -> None:
    @elasticd.elastic(workers=3)
    def train(ctx):
        t = torch.zeros(1)
        dist.recv(t, (ctx.rank + 1) % 3)   # everyone receives first: nobody ever sends
        dist.send(t, (ctx.rank - 1) % 3)

    with pytest.raises(WorkerFailed) as info:
        train()
    message = info.value.message
    assert "Deadlock" in message and "deadlocks under torchrun as well" in message, message
    for r in range(3):
        assert f"logical rank {r} waits in recv from rank {(r + 1) % 3}" in message, message


def test_a_receive_without_a_source_and_a_send_to_oneself_are_refused() -> None:
    errors: dict[int, list[str]] = {}

    @elasticd.elastic(workers=2)
    def train(ctx):
        errors[ctx.rank] = []
        for call in (lambda: dist.recv(torch.zeros(1)), lambda: dist.send(torch.zeros(1), ctx.rank),
                     lambda: dist.send(torch.zeros(1), 7)):
            try:
                call()
            except (NotImplementedError, ValueError) as e:
                errors[ctx.rank].append(f"{type(e).__name__}: {e}")

    train()
    for r in (0, 1):
        assert len(errors[r]) == 3, errors
        assert errors[r][0].startswith("NotImplementedError") and "without src" in errors[r][0]
        assert "should not be the same as the rank" in errors[r][1]
        assert "dst=7 is not a logical rank of 2" in errors[r][2]


@pytest.mark.timeout(300)
def test_a_resize_while_a_message_is_in_flight_is_refused_and_the_job_trains_on() -> None:
    run = cli("run", str(JOBS / "p2p_across_steps.py"), "--workers", "4", "--devices", "2", "--scale-at", "2:1",
              env={"ELASTICD_TEST_WORKERS": "4"}, timeout=240.0)
    assert run.code == 1, run.output   # the result is right; the resize asked for did not happen
    assert "refused" in run.output and "a message from logical rank 1 to rank 0 (tag 0) is sent and not received" \
        in run.output, run.output
    assert "received [10.0, 5.0]" in run.output, run.output   # every message of steps 0..4 arrived, in order
