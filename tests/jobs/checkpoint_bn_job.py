"""BatchNorm where no forward hook of the replicated model sees it run: inside a checkpointed segment
(torch.utils.checkpoint, non-reentrant: its forward runs again in backward) and in a submodule the loop
calls itself (a probe of the features, `model.backbone(x)` under no_grad, every other step).

Under DDP each rank's statistics take its own batches and rank 0's win. Here every hosted worker's recomputed
(or directly called) BatchNorm updated the one shared copy, and BatchNorm's kernel counts no version for it:
0.18-0.27 from DDP in the running statistics, exit 0. Rank 0 writes the model, buffers included.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import save_state
from torch.utils.checkpoint import checkpoint

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = 9


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.block = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(checkpoint(self.block, self.backbone(x), use_reentrant=False))


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    net = Net()
    model, opt = ctx.replicate(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    inner = getattr(model, "module", model)   # DDP's wrapper under --ddp
    g = torch.Generator().manual_seed(ctx.rank)
    for step in ctx.steps(STEPS):
        x = torch.randn(8, 8, generator=g)
        if step % 2 == 0:
            with torch.no_grad():
                inner.backbone(torch.randn(8, 8, generator=g))   # a probe of the features, in training mode
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT")


if __name__ == "__main__":
    train()
