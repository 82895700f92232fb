"""A small MLP trained data-parallel by 4 logical workers, on however many devices elasticd gives it.

    python examples/train_mlp.py                       # standalone: 4 workers on this machine
    elasticd run examples/train_mlp.py --devices 2     # 2 agent processes, no daemon
    elasticd submit examples/train_mlp.py              # through a daemon; `elasticd scale JOB --devices M`

The job is written for N=4 workers (global batch 4 x 64) whatever M is, and computes the same thing
when elasticd shrinks or grows it while it runs.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import elasticd

STEPS = int(os.environ.get("TRAIN_STEPS", "600"))   # the demo asks for more, to resize twice on any machine


def synthetic_data(n: int = 8192, features: int = 64, classes: int = 10) -> TensorDataset:
    """Inputs labelled by a fixed random 'teacher' network: learnable, and the same on every worker."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, features, generator=g)
    teacher = torch.randn(features, classes, generator=g)
    y = (torch.tanh(x) @ teacher).argmax(dim=1)
    return TensorDataset(x, y)


@elasticd.elastic(workers=4)
def train(ctx) -> None:
    torch.manual_seed(0)
    ds = synthetic_data()
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.AdamW(model.to(ctx.device).parameters(), lr=1e-3)
    model, opt = ctx.replicate(model, opt)            # one shared copy per device, DDP-style gradient averaging
    sampler = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
    batches = ctx.batches(DataLoader(ds, batch_size=64, sampler=sampler))  # keeps its place across resizes
    for _step in ctx.steps(STEPS):                    # each step boundary is where a resize may happen
        x, y = next(batches)
        loss = F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
        opt.zero_grad()
        loss.backward()                               # the gradient all-reduce over the 4 workers
        ctx.clip_grad_norm_(1.0)
        opt.step()
        ctx.log(loss=loss.item(), total_steps=STEPS)  # shown by `elasticd status` and `submit --wait`
    if ctx.rank == 0:
        print(f"final loss {loss.item():.4f} after {STEPS} steps", flush=True)


if __name__ == "__main__":
    train()
