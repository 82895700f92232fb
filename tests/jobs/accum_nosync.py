"""Equivalence job: gradient accumulation over 2 micro-batches, the first one under `ctx.no_sync()`.

The first backward only accumulates locally; the second triggers the (single) all-reduce of the sum.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import save_state
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = 20
BATCH = 8
MICRO = 2  # micro-batches per optimizer step


def make_data() -> TensorDataset:
    """A noisy nonlinear regression: y = sin(x @ a) + 0.1 * noise."""
    g = torch.Generator().manual_seed(99)
    x = torch.randn(256, 8, generator=g)
    y = torch.sin(x @ torch.randn(8, 2, generator=g)) + 0.1 * torch.randn(256, 2, generator=g)
    return TensorDataset(x, y)


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 2)).to(ctx.device)
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_INIT")
    torch.manual_seed(300 + ctx.rank)  # distinct dropout masks per rank
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = ctx.replicate(model, opt)
    ds = make_data()
    sampler = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
    batches = ctx.batches(DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=0))
    for _ in ctx.steps(STEPS):
        opt.zero_grad()
        x, y = next(batches)
        with ctx.no_sync():  # local accumulation only; no all-reduce for this backward
            (F.mse_loss(model(x.to(ctx.device)), y.to(ctx.device)) / MICRO).backward()
        x, y = next(batches)
        loss = F.mse_loss(model(x.to(ctx.device)), y.to(ctx.device)) / MICRO
        loss.backward()  # all-reduces the accumulated sum of both micro-batches
        opt.step()
        ctx.log(loss=loss.item() * MICRO)
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT")


if __name__ == "__main__":
    train()
