"""A buffer the training loop changes outside the forward: `model.updates += 1` after each step, read by the
forward (a registered counter that scales the output), beside BatchNorm's statistics.

Every DDP rank adds 1 to its own counter, and each forward starts from rank 0's buffers. Hosted workers
share one buffer: each added 1, so the counter ran once per hosted worker ahead (11-12 after 6 steps on 2
devices of 2 workers) and the forwards read it, exit 0. A second counter the forward rebinds (`self.seen =
self.seen + 1`) stayed at 0 where DDP's reached 9. Rank 0 writes the model, buffers included.
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


class Counted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 1)
        self.register_buffer("updates", torch.zeros(()))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen = self.seen + 1   # rebinds the buffer: a later worker's forward had put the old one back
        return self.out(self.bn(self.fc(x))) * (1 + 0.1 * self.updates) * (1 + 0.01 * self.seen)


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    net = Counted()
    model, opt = ctx.replicate(net, torch.optim.SGD(net.parameters(), lr=0.05))
    inner = getattr(model, "module", model)   # DDP's wrapper under --ddp
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in ctx.steps(STEPS):
        x = torch.randn(8, 4, generator=g)
        loss = F.mse_loss(model(x), x.sum(1, keepdim=True))
        opt.zero_grad()
        loss.backward()
        opt.step()
        inner.updates += 1
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT")


if __name__ == "__main__":
    train()
