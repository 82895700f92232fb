"""Idiom job: `ReduceLROnPlateau` and `ChainedScheduler`, built by every rank after `ctx.replicate`.

`ReduceLROnPlateau.step(metric)` is stepped with a metric averaged over ranks (the same on every rank, as
DDP code must pass it for the ranks' learning rates to stay equal). With ELASTICD_TEST_PER_RANK_METRIC=1
each rank passes its own loss instead: DDP ranks would then drift apart, which one shared learning rate
cannot reproduce, so elasticd must refuse it with an error naming the scheduler.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import assert_same_on_every_rank, classification_data, save_state
from torch.optim.lr_scheduler import ChainedScheduler, ExponentialLR, ReduceLROnPlateau, StepLR
from torch.utils.data import DataLoader, DistributedSampler

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = 24
BATCH = 16


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(ctx.device)
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_INIT")
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    model, opt = ctx.replicate(model, opt)
    plateau = ReduceLROnPlateau(opt, factor=0.5, patience=1, threshold=0.05)
    chained = ChainedScheduler([StepLR(opt, step_size=4, gamma=0.8), ExponentialLR(opt, gamma=0.97)])
    per_rank = os.environ.get("ELASTICD_TEST_PER_RANK_METRIC") == "1"
    ds = classification_data(555)
    sampler = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
    batches = ctx.batches(DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=0))
    lrs: list[float] = []
    reduced = False
    for _ in ctx.steps(STEPS):
        x, y = next(batches)
        loss = F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        metric = torch.tensor([loss.item()])
        if not per_rank:
            ctx.all_reduce(metric)
        before = plateau.get_last_lr()[0]
        plateau.step(metric.item())
        reduced |= plateau.get_last_lr()[0] < before
        chained.step()
        lrs.append(opt.param_groups[0]["lr"])
        ctx.log(loss=loss.item(), lr=lrs[-1])
    if not reduced:
        raise AssertionError("ReduceLROnPlateau never reduced the learning rate: the job does not exercise it")
    assert_same_on_every_rank(ctx, lrs, "the learning rate")
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT")


if __name__ == "__main__":
    train()
