"""Idiom job: an LR scheduler each rank builds over its plain optimizer BEFORE `ctx.replicate`, unregistered.

The first hosted worker's optimizer becomes the shared one, so its scheduler moves the shared learning
rate; the other workers' schedulers move the optimizers `ctx.replicate` set aside, through the same
values. Nothing registers the scheduler: a resize must carry its state anyway (agent/capture/carried.py),
or the learning rate restarts and the result leaves DDP's.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import assert_same_on_every_rank, classification_data, save_state
from torch.optim.lr_scheduler import ExponentialLR, LinearLR, SequentialLR, StepLR
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
    opt = torch.optim.AdamW(model.parameters(), lr=0.02)
    step_lr = StepLR(opt, step_size=5, gamma=0.5)
    warm = SequentialLR(opt, [LinearLR(opt, start_factor=0.25, total_iters=4), ExponentialLR(opt, gamma=0.9)],
                        milestones=[4])
    model, opt = ctx.replicate(model, opt)
    ds = classification_data(777)
    sampler = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
    batches = ctx.batches(DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=0))
    lrs: list[float] = []
    for step in ctx.steps(STEPS):
        x, y = next(batches)
        loss = F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        step_lr.step()
        warm.step()
        lr = opt.param_groups[0]["lr"]
        if warm.get_last_lr()[0] != lr or step_lr.last_epoch != step + 1 or warm.last_epoch != step + 1:
            raise AssertionError(f"rank {ctx.rank} step {step}: schedulers and optimizer disagree: lr {lr}, "
                                 f"{warm.state_dict()}, {step_lr.state_dict()}")
        lrs.append(lr)
        ctx.log(loss=loss.item(), lr=lr)
    assert_same_on_every_rank(ctx, lrs, "the learning rate")
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT")


if __name__ == "__main__":
    train()
