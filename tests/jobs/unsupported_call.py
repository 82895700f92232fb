"""A job that calls a torch.distributed function elasticd cannot run over logical ranks
(a collective on a process group it did not make): the run must fail naming it, not hang or answer with the
agents' view."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    for _ in ctx.steps(2):
        t = torch.ones(1)
        dist.all_reduce(t)  # supported: the job is fine up to the call below
        dist.all_reduce(t, group=object())


if __name__ == "__main__":
    train()
