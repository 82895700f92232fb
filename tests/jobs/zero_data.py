"""Idiom job: `p.grad.data.zero_()` before backward, the pre-1.0 way to clear gradients.

Under DDP every rank clears its own. Through `.data`, which the version counters do not see, each hosted
worker would wipe what the workers before it had accumulated (exit 0); a later worker's write is the
first worker's, made once
(agent/replicated/grad_data.py), on every M.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import classification_data, save_state
from torch.utils.data import DataLoader, DistributedSampler

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = 16
BATCH = 16


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(ctx.device)
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_INIT")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = ctx.replicate(model, opt)
    ds = classification_data(1234)
    sampler = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
    batches = ctx.batches(DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=0))
    for _ in ctx.steps(STEPS):
        x, y = next(batches)
        for p in model.parameters():
            if p.grad is not None:
                p.grad.data.zero_()
        loss = F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
        loss.backward()
        opt.step()
        ctx.log(loss=loss.item())
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT")


if __name__ == "__main__":
    train()
