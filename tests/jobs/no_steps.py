"""A job with the trainer's own `for x, y in loader` loop and no `ctx.steps`: it has no step boundary, so
it cannot be resized, and `--scale-at` must be refused rather than ignored."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    ds = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    model, opt = ctx.replicate(*(lambda m: (m, torch.optim.SGD(m.parameters(), lr=0.1)))(nn.Linear(4, 2)))
    sampler = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank)
    for x, y in DataLoader(ds, batch_size=4, sampler=sampler):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    train()
