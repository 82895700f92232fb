"""A job that sets its sampler's epoch itself before handing the loader to `ctx.batches`.

Every rank appends "step idx idx ..." per step to $ELASTICD_TEST_LOG/rank<r>.log. The data order must be
the one `sampler.set_epoch(START_EPOCH)` gives, epoch after epoch from there, as under DDP.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
START_EPOCH = 3
SAMPLES, BATCH, STEPS = 64, 4, 6  # 4 batches per epoch and rank: the walk crosses into START_EPOCH + 1


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(SAMPLES, 4, generator=g), torch.arange(SAMPLES))


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    ds = dataset()
    model, opt = ctx.replicate(*(lambda m: (m, torch.optim.SGD(m.parameters(), lr=0.1)))(nn.Linear(4, 2)))
    sampler = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
    sampler.set_epoch(START_EPOCH)
    batches = ctx.batches(DataLoader(ds, batch_size=BATCH, sampler=sampler))
    for step in ctx.steps(STEPS):
        x, idx = next(batches)
        with open(os.path.join(os.environ["ELASTICD_TEST_LOG"], f"rank{ctx.rank}.log"), "a") as f:
            f.write(f"{step} {' '.join(map(str, idx.tolist()))}\n")
        loss = F.cross_entropy(model(x), idx % 2)
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    train()
