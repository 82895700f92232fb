"""A job that calls a torch.distributed function elasticd cannot run over logical ranks
(ELASTICD_TEST_CALL names it; default send): the run must fail naming it, not hang or answer with the
agents' view."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
CALL = os.environ.get("ELASTICD_TEST_CALL", "send")


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    for _ in ctx.steps(2):
        t = torch.ones(1)
        dist.all_reduce(t)  # supported: the job is fine up to the call below
        if CALL == "send":
            dist.send(t, dst=(dist.get_rank() + 1) % dist.get_world_size())


if __name__ == "__main__":
    train()
