"""Random generators the function keeps in its own variables (agent/slicer/local_rngs.py).

A `torch.Generator`, a numpy `default_rng`, a legacy `RandomState` and a `random.Random`, each seeded per
rank before the loop and drawn from every step (input noise, a random subset of the batch): under DDP each
keeps its stream for the life of the process. The loop runs in a helper the function calls, so the
generators sit in two frames. Rank 0 writes the model to $ELASTICD_TEST_OUT.
"""

from __future__ import annotations

import os
import random

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import classification_data, save_state

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = 16


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = ctx.replicate(model, opt)
    noise = torch.Generator().manual_seed(10 + ctx.rank)
    pick = np.random.default_rng(20 + ctx.rank)
    legacy = np.random.RandomState(30 + ctx.rank)
    coin = random.Random(40 + ctx.rank)
    x_all, y_all = classification_data(7).tensors

    def loop(noise: torch.Generator) -> None:
        for _ in ctx.steps(STEPS):
            idx = torch.from_numpy(pick.choice(len(x_all), size=16, replace=False))
            x = x_all[idx] + 0.1 * torch.randn(16, 16, generator=noise)
            x = x * float(legacy.uniform(0.5, 1.5)) * (1.0 if coin.random() < 0.7 else -1.0)
            loss = F.cross_entropy(model(x), y_all[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()

    loop(noise)
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT")


if __name__ == "__main__":
    train()
