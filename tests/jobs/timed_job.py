"""A compute-bound job with few parameters, for timing tests: each worker-step is tens of milliseconds of
matmuls while the gradient flush moves only one 256x256 layer, so where an agent's time goes (its own
compute, or waiting in collectives for a slower agent) shows in its timing report."""

from __future__ import annotations

import os

import torch
import torch.nn as nn

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = int(os.environ.get("ELASTICD_TEST_STEPS", "40"))
REPEAT = int(os.environ.get("ELASTICD_TEST_REPEAT", "4"))   # applications of the layer per forward


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(256, 256).to(ctx.device)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-3)
    layer, opt = ctx.replicate(layer, opt)
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in ctx.steps(STEPS):
        x = torch.randn(512, 256, generator=g).to(ctx.device)
        for _ in range(REPEAT):
            x = torch.tanh(layer(x))
        opt.zero_grad()
        x.square().mean().backward()
        opt.step()


if __name__ == "__main__":
    train()
