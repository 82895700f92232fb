"""Memory job: a model big enough that params, grads and AdamW state dominate the process's RSS.

Prints the process's peak RSS in bytes (`PEAK_RSS=<n>`) after training, from logical rank 0.
"""

from __future__ import annotations

import os
import resource

import torch
import torch.nn as nn

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "8"))


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    # ~8.4M parameters: 34 MB each of params, grads, exp_avg, exp_avg_sq.
    model = nn.Sequential(nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2048))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, opt = ctx.replicate(model, opt)
    for _ in ctx.steps(3):
        opt.zero_grad()
        model(torch.randn(4, 2048)).square().mean().backward()
        opt.step()
    ctx.barrier()  # every worker has finished before rank 0 reads the peak
    if ctx.rank == 0:
        print(f"PEAK_RSS={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}", flush=True)


if __name__ == "__main__":
    train()
