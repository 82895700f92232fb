"""SyncBatchNorm in a replicated model (CUDA only: torch refuses it on CPU tensors).

Its backward all-reduces from autograd's device thread, where no worker is current; elasticd must fail the
job naming the call rather than reduce over the agents (tests/agent/test_cuda.py).
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16)))
    model = ctx.replicate(model.to(ctx.device))
    for _ in ctx.steps(2):
        model(torch.randn(4, 8, device=ctx.device)).square().mean().backward()


if __name__ == "__main__":
    train()
