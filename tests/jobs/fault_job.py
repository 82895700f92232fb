"""Page faults per step of 8 hosted workers in deterministic mode (tests/agent/slicer/test_memory.py).

Each rank stashes a 2.6 MB gradient buffer every step and the flush adds them up: if freed heap went back
to the kernel at each free, the next worker would fault it in again, page by page (agent/slicer/malloc.py).
Logical rank 0 prints the process's minor page faults per step over steps WARM..STEPS (`FAULTS=<n>`).
"""

from __future__ import annotations

import resource

import torch
import torch.nn as nn
import torch.nn.functional as F

import elasticd

WARM, STEPS = 5, 25


@elasticd.elastic(workers=8, deterministic=True)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512),
                          nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    model, opt = ctx.replicate(model, opt)
    g = torch.Generator().manual_seed(ctx.rank)
    start = 0
    for step in ctx.steps(STEPS):
        if ctx.rank == 0 and step == WARM:
            start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        x = torch.randn(32, 64, generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), x[:, :10].argmax(1)).backward()
        opt.step()
    if ctx.rank == 0:
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start
        print(f"FAULTS={faults // (STEPS - WARM)}", flush=True)


if __name__ == "__main__":
    train()
