"""Writes through a replicated parameter's `.data` by the function's own code, as older scripts make them.

pytorch/examples' word_language_model steps by hand: `ctx.replicate(model)` without an optimizer,
`clip_grad_norm_`, then `p.data.add_(p.grad, alpha=-lr)`; then a hand-made weight decay
`p.data.mul_(0.99)` and WGAN's clamp `p.data.clamp_(-0.3, 0.3)`. Every DDP rank makes each write once to its
own copy. Hosted workers share one copy: the add and the decay were applied once per hosted worker, exit 0.
Rank 0 writes the model to $ELASTICD_TEST_OUT.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import save_state

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = 9


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = ctx.replicate(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in ctx.steps(STEPS):
        x = torch.randn(8, 4, generator=g)
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
        model.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
        for p in model.parameters():
            p.data.add_(p.grad, alpha=-0.2)
            p.data.mul_(0.99)
            p.data.clamp_(-0.3, 0.3)
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT")


if __name__ == "__main__":
    train()
