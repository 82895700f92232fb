"""An evaluation after a collective, on a model with BatchNorm and dropout, every step.

Each step trains, then `model.eval()`, takes rank 0's probe batch (`dist.broadcast`) and evaluates it. The
broadcast hands the device to the next hosted worker, so the workers of an agent reach their evaluations
at different times: one shared model must still evaluate in eval mode (the first worker's `model.train()`
had switched it back) and with rank 0's running statistics of that step (not those its next training
forward left). Under DDP every rank evaluates the same batch with the same statistics: the same numbers.
Rank 0 writes the model and every rank's evaluations (`evals`, ranks x steps) to $ELASTICD_TEST_OUT.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
from _jobstate import save_with_every_ranks

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = 9


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 1))
    model, opt = ctx.replicate(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(ctx.rank)
    evals: list[float] = []
    for _ in ctx.steps(STEPS):
        loss = model(torch.randn(8, 4, generator=g)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        model.eval()
        probe = torch.randn(4, 4, generator=g)
        dist.broadcast(probe, 0)
        with torch.no_grad():
            evals.append(model(probe).sum().item())
        model.train()
    save_with_every_ranks(ctx, model, evals, "evals")


if __name__ == "__main__":
    train()
