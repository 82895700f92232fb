"""Idiom job: LR schedulers each rank builds itself over the optimizer `ctx.replicate` returned.

Every rank constructs its own `StepLR` and `SequentialLR(LinearLR warm-up, ExponentialLR)` after
`ctx.replicate` and steps them every step: the shared learning rate must move once per step, as each DDP
rank's does, and every rank's schedulers must agree with each other and with the optimizer.
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
    model, opt = ctx.replicate(model, opt)
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"{type(opt).__name__} is not an Optimizer")
    step_lr = StepLR(opt, step_size=5, gamma=0.5)
    warm = SequentialLR(opt, [LinearLR(opt, start_factor=0.25, total_iters=4), ExponentialLR(opt, gamma=0.9)],
                        milestones=[4])
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
