"""Idiom job: references into the model taken before it is wrapped, as DDP code takes them freely.

Under DDP the module a rank wraps is the one it trains, so `body = model[:3]` kept for an auxiliary loss,
and a head kept to log its norm, train and read the wrapped parameters. Both must do so here too, on
every logical rank (not only on the first hosted worker, whose model is the shared copy). With
ELASTICD_TEST_PENALTY=1 the job also adds an L2 penalty over `list(model.parameters())` taken before
the wrap: those parameter objects cannot become the shared ones, so that run must fail naming one.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import assert_same_on_every_rank, classification_data, save_state
from torch.utils.data import DataLoader, DistributedSampler

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = 16
BATCH = 16


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    model = model.to(ctx.device)
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_INIT")
    body, head = model[:3], model[4]          # held from before the wrap
    params = list(model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, opt = ctx.replicate(model, opt)
    ds = classification_data(4321)
    sampler = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
    batches = ctx.batches(DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=0))
    norms: list[float] = []
    for _ in ctx.steps(STEPS):
        x, y = next(batches)
        x, y = x.to(ctx.device), y.to(ctx.device)
        loss = F.cross_entropy(model(x), y) + 0.5 * body(x).pow(2).mean()
        if os.environ.get("ELASTICD_TEST_PENALTY") == "1":
            loss = loss + 1e-2 * sum(p.pow(2).sum() for p in params)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            norms.append(head.weight.norm().item())
    assert_same_on_every_rank(ctx, norms, "the norm of the head held from before the wrap")
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT")


if __name__ == "__main__":
    train()
