"""LBFGS: an optimizer whose step calls a closure that runs forward and backward again, once per evaluation.

ELASTICD_TEST_LBFGS picks where the model lives: `replicated` (ctx.replicate, refused: the shared step cannot
call each worker's closure) or `ddp` (torch's DistributedDataParallel inside the function, each worker's own
model and optimizer, as each DDP rank has them). Rank 0 writes the model to $ELASTICD_TEST_OUT.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import classification_data, save_state

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
VARIANT = os.environ.get("ELASTICD_TEST_LBFGS", "ddp")


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    if VARIANT == "replicated":
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=5)
        model, opt = ctx.replicate(model, opt)
    else:
        model = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=5)
    x_all, y_all = classification_data(31).tensors
    for step in ctx.steps(6):
        lo = (step * ctx.world_size + ctx.rank) * 16 % 480
        x, y = x_all[lo:lo + 16], y_all[lo:lo + 16]

        def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss

        opt.step(closure)
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT")


if __name__ == "__main__":
    train()
