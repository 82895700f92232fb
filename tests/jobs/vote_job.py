"""A job whose logical rank 0 appends, at each step start, how many whole-group collectives its agent has
run and on how many agents it runs (tests/agent/comm/test_carried_vote.py); deterministic when
ELASTICD_TEST_DETERMINISTIC=1.

Step EXTRA (env ELASTICD_TEST_EXTRA, default 5) reduces its loss with `ctx.all_reduce` after backward, so
the last collective before that boundary is not a gradient flush and the agents must vote apart.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import elasticd

STEPS = 12
EXTRA = int(os.environ.get("ELASTICD_TEST_EXTRA", "5"))


@elasticd.elastic(workers=4, deterministic=os.environ.get("ELASTICD_TEST_DETERMINISTIC") == "1")
def train(ctx):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ctx.replicate(model, opt)
    g = torch.Generator().manual_seed(ctx.rank)
    for step in ctx.steps(STEPS):
        phys = ctx._rt.phys   # the agents' group: what this test counts
        if ctx.rank == 0:     # one line a step, appended: a resize runs the function again
            with open(os.environ["ELASTICD_TEST_OUT"], "a") as f:
                f.write(json.dumps({"step": step, "collectives": phys.collectives, "agents": phys.world}) + "\n")
        x = torch.randn(16, 8, generator=g)
        loss = F.cross_entropy(model(x), (x.sum(1) > 0).long())
        opt.zero_grad()
        loss.backward()
        if step == EXTRA:
            ctx.all_reduce(loss.detach().clone())
        opt.step()


if __name__ == "__main__":
    train()
