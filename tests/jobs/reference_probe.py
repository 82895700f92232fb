"""What a rank of the plain-DDP reference (`elasticd run --ddp`) is: each writes $ELASTICD_TEST_OUT/rank<r>.json
with the elasticd patches installed in it (none may be), its parent's command line, its sys.argv[0], its
unseeded torch seed and RANK; then the ranks train a small model with DDP and rank 0 saves it to
$ELASTICD_TEST_OUT/model.pt (forked and cold ranks must save the same bits)."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import elasticd
from elasticd.agent import patches

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "2"))


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    out = os.environ["ELASTICD_TEST_OUT"]
    with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
        parent = f.read().split(b"\0")
    seen = {"patches": patches.installed(), "parent": [a.decode() for a in parent if a], "argv0": sys.argv[0],
            "seed": torch.initial_seed(), "rank": int(os.environ["RANK"])}
    with open(os.path.join(out, f"rank{ctx.rank}.json"), "w") as f:
        json.dump(seen, f)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    model, opt = ctx.replicate(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    g = torch.Generator().manual_seed(1 + ctx.rank)
    for _ in ctx.steps(5):
        x = torch.randn(16, 8, generator=g)
        loss = F.mse_loss(model(x), x[:, :2])
        opt.zero_grad()
        loss.backward()
        opt.step()
    if ctx.rank == 0:
        torch.save({k: v.detach().clone() for k, v in net.state_dict().items()}, os.path.join(out, "model.pt"))


if __name__ == "__main__":
    train()
