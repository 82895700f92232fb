"""Idiom job: `torch.amp.GradScaler` with CPU autocast on a replicated model.

The documented loop (scale(loss).backward(); unscale_; clip; step; update) must unscale the averaged
gradient once per step, skip the same steps as DDP (logical rank 1 makes its loss infinite at one step:
DDP's all-reduce spreads the inf to every rank, so every rank skips and backs off) and leave every
rank's scaler with the same scale and growth tracker.
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
STEPS = 24
BATCH = 16
INF_STEP = 9  # the step at which rank 1's loss is infinite (after the resize in the resize test)


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(ctx.device)
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_INIT")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = ctx.replicate(model, opt)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    ds = classification_data(4321)
    sampler = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
    batches = ctx.batches(DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=0))
    scales: list[float] = []
    for step in ctx.steps(STEPS):
        x, y = next(batches)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x.to(ctx.device))
        loss = F.cross_entropy(out.float(), y.to(ctx.device))
        if step == INF_STEP and ctx.rank == 1:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        scales += [scaler.get_scale(), float(scaler._get_growth_tracker())]
        ctx.log(loss=loss.item(), scale=scaler.get_scale())
    assert_same_on_every_rank(ctx, scales, "the GradScaler's scale and growth tracker")
    if ctx.rank == 0:
        # The scaler's state is part of the result: a resize must carry it (the model alone would not
        # show a scaler that restarted from init_scale, as long as no step overflows).
        save_state(model, "ELASTICD_TEST_OUT", extra={
            "scaler.scale": torch.tensor(scaler.get_scale()),
            "scaler.growth_tracker": torch.tensor(float(scaler._get_growth_tracker()))})


if __name__ == "__main__":
    train()
