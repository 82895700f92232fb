"""A job that catches an error raised inside backward and goes on, as code that retries a failed batch
does. Ranks 1 and 3 (each the last hosted worker of its agent on 2 devices, whose backward starts the
gradient buckets' all-reduce) raise from a tensor hook at step 2, after the last layers' gradients are
done. Under DDP that rank's peers would wait in the all-reduce its reducer began; here the run must stop
with an error that says why, not hang or go on with a half-reduced step.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))


class Flaky(RuntimeError):
    pass


def boom(grad: torch.Tensor) -> None:
    raise Flaky("a batch the job chooses to skip")


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Sequential(nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.to(ctx.device).parameters(), lr=0.1)
    model, opt = ctx.replicate(model, opt)
    first, rest = model[0], model[1]   # the shared model's layers: this worker's own copy is set aside
    for step in ctx.steps(6):
        x = torch.randn(16, 8, device=ctx.device)
        h = first(x)
        if ctx.rank % 2 == 1 and step == 2:
            h.register_hook(boom)
        loss = F.mse_loss(rest(h), torch.zeros(16, 4, device=ctx.device))
        opt.zero_grad()
        try:
            loss.backward()
        except Flaky:
            continue
        opt.step()


if __name__ == "__main__":
    train()
