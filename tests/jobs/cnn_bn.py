"""Equivalence job: CNN with BatchNorm and dropout, AdamW, a StepLR scheduler and gradient clipping.

Pins DDP's buffer semantics (rank 0's BatchNorm statistics win), per-rank dropout RNG, a scheduler
stepped once per step, and clipping applied to the *averaged* gradient.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import save_state
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = 20
BATCH = 8


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # bias=False before BatchNorm: BN cancels a conv bias, so its gradient is mathematically zero and
        # round-off-only, which AdamW would blow up into O(lr) steps (docs/architecture.md, what must hold, 1).
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 8, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.25)
        self.fc = nn.Linear(8 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(self.drop(x.flatten(1)))


def make_data() -> TensorDataset:
    """Three classes of 8x8 images: a bright row, column or diagonal, plus noise."""
    g = torch.Generator().manual_seed(4321)
    n = 256
    y = torch.randint(0, 3, (n,), generator=g)
    x = 0.5 * torch.randn(n, 1, 8, 8, generator=g)
    pos = torch.randint(0, 8, (n,), generator=g)
    for i in range(n):
        p = int(pos[i])
        if y[i] == 0:
            x[i, 0, p, :] += 2.0
        elif y[i] == 1:
            x[i, 0, :, p] += 2.0
        else:
            x[i, 0].diagonal().add_(2.0)
    return TensorDataset(x, y)


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = Net().to(ctx.device)
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_INIT")
    torch.manual_seed(100 + ctx.rank)  # distinct dropout masks per rank, as a real job would have
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    model, opt, sched = ctx.replicate(model, opt, sched)
    ds = make_data()
    sampler = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
    batches = ctx.batches(DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=0))
    for _ in ctx.steps(STEPS):
        x, y = next(batches)
        # x3: keeps the averaged gradient norm above the clip threshold for most steps, so clipping acts.
        loss = 3.0 * F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
        opt.zero_grad()
        loss.backward()
        norm = ctx.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        ctx.log(loss=loss.item(), grad_norm=float(norm), lr=sched.get_last_lr()[0])
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT")


if __name__ == "__main__":
    train()
