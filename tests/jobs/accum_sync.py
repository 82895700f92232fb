"""Idiom job: gradient accumulation by two forward/backward passes per step WITHOUT `no_sync`.

Valid under DDP: each backward all-reduces and the averages add up, grad = avg(g1) + avg(g2). The first
flush leaves the common average in the shared `.grad`; the second must not average it again. Clears with
`model.zero_grad()` every other step, so gradients also carry over into the next step's first pass on the
others (DDP lets them). Deterministic mode is switched by env.
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
DETERMINISTIC = os.environ.get("ELASTICD_TEST_DETERMINISTIC", "0") == "1"
STEPS = 16
BATCH = 8


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(99)
    x = torch.randn(512, 8, generator=g)
    y = torch.sin(x @ torch.randn(8, 2, generator=g)) + 0.1 * torch.randn(512, 2, generator=g)
    return TensorDataset(x, y)


@elasticd.elastic(workers=WORKERS, deterministic=DETERMINISTIC)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 2)).to(ctx.device)
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_INIT")
    torch.manual_seed(300 + ctx.rank)  # distinct dropout masks per rank
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = ctx.replicate(model, opt)
    ds = make_data()
    sampler = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
    batches = ctx.batches(DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=0))
    for step in ctx.steps(STEPS):
        if step % 2 == 0:
            model.zero_grad()
        for _ in range(2):
            x, y = next(batches)
            loss = F.mse_loss(model(x.to(ctx.device)), y.to(ctx.device)) / 2
            loss.backward()  # all-reduces: the averages of both passes add up in .grad
        opt.step()
        ctx.log(loss=loss.item() * 2)
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT")


if __name__ == "__main__":
    train()
