"""A job whose data is drawn before the loop from a stream seeded at the module's top level, once per
process (rasbt/LLMs-from-scratch's DDP script seeds in its `__main__` block and adds `randn_like` noise to
its dataset inside the training function).

The code before `ctx.steps` runs again after a resize. Under DDP it ran once per rank, from the stream the
process started the function with; here a re-entered worker must draw the same numbers, so the dataset
and the model's initial weights (also drawn, unseeded inside the function) do not change at a resize.
Rank 0 writes the final model and a checksum of its dataset ($ELASTICD_TEST_OUT).
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
torch.manual_seed(123)   # once per process, at import: the stream every rank's function starts from


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    x = torch.randn(64, 8)
    x = x + 0.1 * torch.randn_like(x)              # noise, as the script adds to its features
    y = (x.sum(1) > 0).long()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    model, opt = ctx.replicate(model, opt)
    per_rank = 64 // ctx.world_size
    mine = slice(ctx.rank * per_rank, (ctx.rank + 1) * per_rank)
    for _step in ctx.steps(STEPS):
        loss = F.cross_entropy(model(x[mine]), y[mine])
        opt.zero_grad()
        loss.backward()
        opt.step()
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT", {"data_sum": x.sum().reshape(1)})


if __name__ == "__main__":
    train()
