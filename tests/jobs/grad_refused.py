"""Idiom job: changes of replicated state elasticd refuses ($ELASTICD_TEST_IDIOM picks one).

- grad_mul:   `p.grad.mul_(0.5)` after backward (each hosted worker would scale the shared .grad again)
- grad_zero:  `model.zero_grad(set_to_none=False)` (zeroes in place: would wipe the other hosted
              workers' gradients)
- param_mul:  `with torch.no_grad(): p.mul_(0.99)` (each hosted worker would decay the shared weights)
- grad_data_partial: `p.grad.data.mul_(0.5)` between a backward under `ctx.no_sync()` and the step's last one
              (the shared .grad holds every hosted worker's unaveraged share: DDP halves only the rank's own)
All run under DDP; under elasticd each must stop the run with an error naming it, never exit 0.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import save_state

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
IDIOM = os.environ.get("ELASTICD_TEST_IDIOM", "grad_mul")
STEPS = 4


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = ctx.replicate(model, opt)
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in ctx.steps(STEPS):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 2, generator=g)
        if IDIOM == "grad_zero":
            model.zero_grad(set_to_none=False)
        else:
            opt.zero_grad()
        if IDIOM == "grad_data_partial":
            with ctx.no_sync():
                F.mse_loss(model(x.to(ctx.device)), y.to(ctx.device)).backward()
            for p in model.parameters():
                p.grad.data.mul_(0.5)
        F.mse_loss(model(x.to(ctx.device)), y.to(ctx.device)).backward()
        if IDIOM == "grad_mul":
            for p in model.parameters():
                p.grad.mul_(0.5)
        opt.step()
        if IDIOM == "param_mul":
            with torch.no_grad():
                for p in model.parameters():
                    p.mul_(0.99)
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT")


if __name__ == "__main__":
    train()
