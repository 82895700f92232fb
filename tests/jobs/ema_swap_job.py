"""An EMA swapped into the replicated model through `p.data` to evaluate, across a collective, and back.

torch_ema's `with ema.average_parameters(): evaluate()`, written out: store the weights, `p.data.copy_` the
EMA in, take rank 0's probe batch (`dist.broadcast`: a hand-over to the device's next worker), evaluate,
copy the weights back. Under DDP each rank swaps its own model. Without it, the next worker ran with the first
one's EMA in place, stored it as its training weights and restored those at the end: training went on
from the EMA, 0.49 from DDP, exit 0. Rank 0 writes the model and every rank's evaluations (`evals`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import save_with_every_ranks

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = 9


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model, opt = ctx.replicate(model, torch.optim.SGD(model.parameters(), lr=0.1))
    inner = getattr(model, "module", model)   # DDP's wrapper under --ddp
    shadow = [p.detach().clone() for p in inner.parameters()]
    g = torch.Generator().manual_seed(ctx.rank)
    evals: list[float] = []
    for step in ctx.steps(STEPS):
        x = torch.randn(8, 4, generator=g)
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            for s, p in zip(shadow, inner.parameters(), strict=True):
                s.mul_(0.8).add_(p.detach(), alpha=0.2)
        stored = [p.detach().clone() for p in inner.parameters()]
        for s, p in zip(shadow, inner.parameters(), strict=True):
            p.data.copy_(s.data)
        probe = torch.full((2, 4), float(step + 1))
        dist.broadcast(probe, 0)
        with torch.no_grad():
            evals.append(inner(probe).sum().item())
        for c, p in zip(stored, inner.parameters(), strict=True):
            p.data.copy_(c.data)
    save_with_every_ranks(ctx, model, evals, "evals")


if __name__ == "__main__":
    train()
