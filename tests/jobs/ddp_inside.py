"""Equivalence job: the function wraps its own model in torch's DistributedDataParallel.

Written as for torchrun: `from torch.nn.parallel import DistributedDataParallel as DDP` bound at import,
`dist.get_rank()` / `dist.all_reduce` for logging, a plain optimizer, `model.no_sync()` for gradient
accumulation. Pins, against real DDP: the constructor's broadcast of rank 0's state (every rank builds a
different model here), rank 0's buffers winning at forward, including DDP's rule that a forward right
after a no_grad or no_sync forward does not sync them (a buffer the forward reads makes that visible in
the gradients), per-rank dropout, a head only even ranks use (averaged with zero contribution) and one
no rank uses (its grad stays None, so weight decay must not move it).
"""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = 20
BATCH = 8
NEVER_USED = "module.never.weight"  # no rank ever uses this head


class RunningCenter(nn.Module):
    """Subtracts a running mean of its input. Unlike BatchNorm's statistics in training, this buffer shapes
    the output, so which rank's buffer a forward sees (DDP's buffer broadcast) reaches the gradients."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = x - self.mean
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.5).add_(x.mean(dim=0), alpha=0.5)
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 16, bias=False)  # bias-free before BN: its gradient would be round-off only
        self.bn = nn.BatchNorm1d(16)
        self.drop = nn.Dropout(0.2)
        self.center = RunningCenter(16)  # after BatchNorm, which would cancel a shift of its input
        self.out = nn.Linear(16, 3)
        self.aux = nn.Linear(16, 3)    # used on even ranks only
        self.never = nn.Linear(16, 3, bias=False)

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        h = self.center(self.drop(F.relu(self.bn(self.fc1(x)))))
        return self.out(h) + self.aux(h) if use_aux else self.out(h)


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(2024)
    x = torch.randn(320, 6, generator=g)
    y = (x @ torch.randn(6, 3, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def save(obj: dict, env: str) -> None:
    path = os.environ.get(env)
    if path:
        torch.save(obj, path)


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1000 + rank)  # a different model on every rank: DDP's constructor makes them rank 0's
    model = Net().to(ctx.device)
    model = DDP(model, find_unused_parameters=True)
    if rank == 0:
        save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, "ELASTICD_TEST_INIT")
        info = os.environ.get("ELASTICD_TEST_INFO")
        if info:
            with open(info, "w") as f:
                json.dump({"wrapper": f"{type(model).__module__}.{type(model).__qualname__}",
                           "world": world, "initialized": dist.is_initialized()}, f)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    ds = make_data()
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    batches = ctx.batches(DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=0))
    use_aux = rank % 2 == 0
    for step in ctx.steps(STEPS):
        opt.zero_grad()
        x, y = next(batches)
        with model.no_sync():  # accumulate locally; the next synced backward averages the sum
            (F.cross_entropy(model(x.to(ctx.device), use_aux), y.to(ctx.device)) / 2).backward()
        x, y = next(batches)
        loss = F.cross_entropy(model(x.to(ctx.device), use_aux), y.to(ctx.device)) / 2
        loss.backward()
        opt.step()
        if step % 5 == 4:  # a monitoring forward in train mode: rank-local BN statistics until the next sync
            with torch.no_grad():
                model(x.to(ctx.device), use_aux)
        logged = loss.detach() * 2
        dist.all_reduce(logged)
        ctx.log(loss=logged.item() / world)
    if rank == 0:
        save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, "ELASTICD_TEST_OUT")


if __name__ == "__main__":
    train()
