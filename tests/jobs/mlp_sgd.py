"""Equivalence job: an MLP trained with SGD + momentum (the plainest DDP case)."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import classification_data, save_state
from torch.utils.data import DataLoader, DistributedSampler

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = 24
BATCH = 16  # per rank; 512 samples / 4 ranks / 16 = 8 steps per epoch, so set_epoch matters


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    model = model.to(ctx.device)
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_INIT")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = ctx.replicate(model, opt)
    ds = classification_data(1234)
    sampler = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
    batches = ctx.batches(DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=0))
    for _ in ctx.steps(STEPS):
        x, y = next(batches)
        loss = F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.log(loss=loss.item())
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT")


if __name__ == "__main__":
    train()
