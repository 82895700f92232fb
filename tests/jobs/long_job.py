"""A control-plane test job that trains until it is stopped (or for CP_LONG_STEPS steps). With
ELASTICD_TEST_UNSAVABLE=1 it holds a state no snapshot can carry (tests/jobs/_jobstate.py)."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import unsavable

import elasticd


@elasticd.elastic(workers=4)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Linear(8, 2).to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = ctx.replicate(model, opt)
    g = torch.Generator().manual_seed(ctx.rank)
    warmup = unsavable()  # noqa: F841 - held, never used
    for _ in ctx.steps(int(os.environ.get("CP_LONG_STEPS", "1000000"))):
        x = torch.randn(16, 8, generator=g)
        loss = F.mse_loss(model(x.to(ctx.device)), torch.zeros(16, 2, device=ctx.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.log(loss=loss.item())


if __name__ == "__main__":
    train()
