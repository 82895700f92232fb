"""A decorated function whose model is wrapped in DDP by a helper module that imported
DistributedDataParallel by name before anything of elasticd ran (tests/jobs/tutorial_parts.py): run
standalone (`python ddp_helper_standalone.py`), that name must still build the logical DDP. With
ELASTICD_TEST_FAIL_RANK=r, logical rank r raises after its first step, to show its traceback reaches the user.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler
from tutorial_parts import Net, dataset, wrap

import elasticd

FAIL_RANK = int(os.environ.get("ELASTICD_TEST_FAIL_RANK", "-1"))


def fail_here(rank: int) -> None:
    raise ValueError(f"rank {rank} refuses to go on")


@elasticd.elastic(workers=4)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = wrap(Net(), ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ds = dataset()
    loader = DataLoader(ds, batch_size=16, sampler=DistributedSampler(ds, num_replicas=4, rank=dist.get_rank()))
    batches = ctx.batches(loader)
    for _ in ctx.steps(3):
        x, y = next(batches)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        if ctx.rank == FAIL_RANK:
            fail_here(ctx.rank)
    if ctx.rank == 0:
        print(f"wrapper={type(model).__name__} RANK={os.environ['RANK']} initialized={dist.is_initialized()}")


if __name__ == "__main__":
    train()
