"""Failure job: logical rank 2 raises at step 3 while the others wait in the gradient all-reduce.

A run must stop every worker, name the rank, show the traceback and exit non-zero, not hang.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
FAIL_RANK, FAIL_STEP = 2, 3


class DeliberateFailure(RuntimeError):
    pass


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Linear(4, 2).to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ctx.replicate(model, opt)
    for step in ctx.steps(20):
        if ctx.rank == FAIL_RANK and step == FAIL_STEP:
            raise DeliberateFailure(f"deliberate failure on logical rank {ctx.rank} at step {step}")
        x = torch.randn(8, 4, device=ctx.device)
        loss = F.mse_loss(model(x), torch.zeros(8, 2, device=ctx.device))
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    train()
