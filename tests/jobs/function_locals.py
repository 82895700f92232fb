"""What the function keeps in its own variables (agent/capture/function_locals.py).

A `torch.Generator`, a numpy `default_rng`, a legacy `RandomState` and a `random.Random`, each seeded per
rank before the loop and drawn from every step (input noise, a random subset of the batch): under DDP each
keeps its stream for the life of the process. So do plain values the loop changes: an iteration counter
setting the learning rate by hand (nanoGPT's `get_lr(iter_num)`), a loss history, a best-so-far loss, and
a tensor: the batch indices drawn at the end of each step for the next (nanoGPT's prefetch). And an object
of the script's own class, build-nanogpt's `DataLoaderLite` cut down: a position in a shard, moving on to
the next shard (its tokens loaded afresh) every second step. The loop runs in a helper the function calls,
so these sit in two frames. Rank 0 writes the model to $ELASTICD_TEST_OUT.
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


class ShardWalker:
    """Rows of `data` in shards of `shard_rows`, each rank taking every world-th row of the shard it is in."""

    def __init__(self, data: torch.Tensor, shard_rows: int, rank: int, world: int) -> None:
        self.data, self.shard_rows, self.rank, self.world = data, shard_rows, rank, world
        self.shard = 0
        self.rows = self.load(0)
        self.position = rank

    def load(self, shard: int) -> torch.Tensor:
        return self.data[shard * self.shard_rows:(shard + 1) * self.shard_rows].clone()

    def next_row(self) -> torch.Tensor:
        row = self.rows[self.position]
        self.position += self.world
        if self.position >= len(self.rows):
            self.shard = (self.shard + 1) % (len(self.data) // self.shard_rows)
            self.rows = self.load(self.shard)
            self.position = self.rank
        return row


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
    walker = ShardWalker(torch.randn(5 * 2 * WORKERS, 16, generator=torch.Generator().manual_seed(50)), 2 * WORKERS,
                         ctx.rank, ctx.world_size)

    def batch() -> torch.Tensor:
        return torch.from_numpy(pick.choice(len(x_all), size=16, replace=False))

    def loop(noise: torch.Generator) -> None:
        iter_num, best = 0, float("inf")
        history: list[float] = []
        idx = batch()   # nanoGPT's prefetch: each step takes the batch drawn at the end of the one before
        for _ in ctx.steps(STEPS):
            for group in opt.param_groups:
                group["lr"] = 0.1 * 0.8 ** iter_num
            x = x_all[idx] + 0.1 / (1 + len(history)) * torch.randn(16, 16, generator=noise)
            x = x * float(legacy.uniform(0.5, 1.5)) * (1.0 if coin.random() < 0.7 else -1.0) + walker.next_row()
            if history and history[-1] > best:
                x = 0.5 * x
            loss = F.cross_entropy(model(x), y_all[idx])
            idx = batch()
            opt.zero_grad()
            loss.backward()
            opt.step()
            history.append(loss.item())
            best = min(best, history[-1])
            iter_num += 1

    loop(noise)
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT")


if __name__ == "__main__":
    train()
