"""A message sent in one step and received in the next (rank 1 to rank 0), around a training step: messages are
not carried across a resize, so a resize between the two refuses, naming the ranks, and the job trains on."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    w = torch.zeros(2)
    for step in ctx.steps(6):
        if ctx.rank == 1:
            dist.send(torch.tensor([float(step), 1.0]), 0)
        if ctx.rank == 0 and step > 0:
            got = torch.zeros(2)
            dist.recv(got, 1)
            w += got
        t = torch.ones(1)
        dist.all_reduce(t)
    if ctx.rank == 0:
        print(f"received {w.tolist()}", flush=True)


if __name__ == "__main__":
    train()
