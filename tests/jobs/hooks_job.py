"""Hooks registered inside the function after `ctx.replicate`, on the shared model, as a DDP script would.

- `p.register_hook(lambda g: g * 0.1)` on the first layer: a learning-rate multiplier for that layer;
- a forward hook on the activation that halves its output;
- a forward hook that counts this worker's forward passes into a list of its own;
- registered before `ctx.replicate`, as DDP scripts do before wrapping: a forward hook collecting the
  activations of this worker's pass for a penalty in its loss, and a gradient hook doubling a bias's.

Under DDP each rank's hooks see its own passes. Each ran once per hosted worker on every pass here (the
gradient scaled by 0.1 per hosted worker, the output halved per hosted worker), and those registered before ran on the first worker's
model only, which every worker shares: the later workers' losses lacked their penalty; exit 0. Rank 0 writes the
model and every rank's count (`calls`) to $ELASTICD_TEST_OUT.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import save_state

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = 8


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    acts: list[torch.Tensor] = []
    model[1].register_forward_hook(lambda m, i, o: acts.append(o))   # before wrapping, as scripts do
    model[2].bias.register_hook(lambda g: g * 2.0)
    model, opt = ctx.replicate(model, torch.optim.SGD(model.parameters(), lr=0.1))
    inner = getattr(model, "module", model)   # DDP's wrapper under --ddp
    for p in inner[0].parameters():
        p.register_hook(lambda g: g * 0.1)
    inner[1].register_forward_hook(lambda m, i, o: o * 0.5)
    calls: list[int] = []
    inner[2].register_forward_pre_hook(lambda m, i: calls.append(1))
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in ctx.steps(STEPS):
        x = torch.randn(8, 4, generator=g)
        acts.clear()
        out = model(x)
        loss = F.mse_loss(out, x.sum(1, keepdim=True)) + 0.1 * sum(a.pow(2).mean() for a in acts)
        opt.zero_grad()
        loss.backward()
        opt.step()
    counts = [torch.zeros(1) for _ in range(ctx.world_size)]
    dist.all_gather(counts, torch.tensor([float(len(calls))]))
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT", extra={"calls": torch.cat(counts)})


if __name__ == "__main__":
    train()
