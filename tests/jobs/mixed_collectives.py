"""Collectives job: torch.distributed calls and their ctx counterparts, interleaved, over several rounds.

Every rank records what each collective gave it and saves that to $ELASTICD_TEST_OUT/rank<r>.pt, so
the test can compare all ranks' results with the same script run under real torch.distributed. Inputs
differ per rank (seeded by rank) and mix float and integer tensors; async handles are waited on after
other collectives have run, as a real job overlapping communication would.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
ROUNDS = 3


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(7000 + rank)
    res: dict[str, torch.Tensor] = {
        "identity": torch.tensor([rank, world, ctx.rank, ctx.world_size, int(dist.is_initialized())]),
    }
    for step in ctx.steps(ROUNDS):
        p = f"r{step}."
        metrics = torch.randn(3, generator=g)  # per-rank metrics, e.g. loss, accuracy, grad norm
        counts = torch.randint(0, 1000, (2,), generator=g)

        # async all_reduce, waited on only after the gathers and broadcasts below
        pending = torch.randn(5, generator=g)
        handle = dist.all_reduce(pending, async_op=True)
        pending_ctx = counts.clone()
        handle_ctx = ctx.all_reduce(pending_ctx, async_op=True)

        gathered = [torch.empty_like(metrics) for _ in range(world)]
        dist.all_gather(gathered, metrics)
        res[p + "dist.all_gather"] = torch.stack(gathered)
        res[p + "ctx.all_gather"] = torch.stack(ctx.all_gather(counts))
        flat = torch.empty(world * 2, dtype=torch.int64)
        dist.all_gather_into_tensor(flat, counts)
        res[p + "dist.all_gather_into_tensor"] = flat

        b = torch.randn(4, generator=g)
        dist.broadcast(b, src=2)
        res[p + "dist.broadcast"] = b
        b_ctx = torch.arange(5) * (rank + 1)
        ctx.broadcast(b_ctx, src=2)
        res[p + "ctx.broadcast"] = b_ctx

        top = metrics.clone()
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        res[p + "dist.all_reduce.max"] = top
        handle.wait()
        handle_ctx.wait()
        res[p + "dist.all_reduce.async"] = pending
        res[p + "ctx.all_reduce.async"] = pending_ctx

        chunks = [torch.randn(3, generator=g) for _ in range(world)]
        out = torch.empty(3)
        dist.reduce_scatter(out, chunks)
        res[p + "dist.reduce_scatter"] = out
        stacked = torch.randint(0, 50, (world * 2,), generator=g)
        out_i = torch.empty(2, dtype=torch.int64)
        dist.reduce_scatter_tensor(out_i, stacked)
        res[p + "dist.reduce_scatter_tensor"] = out_i
        out_ctx = torch.empty(3)
        ctx.reduce_scatter(out_ctx, [c * (rank + 1) for c in chunks])
        res[p + "ctx.reduce_scatter"] = out_ctx

        dist.barrier(async_op=True).wait()
        ctx.barrier()
    path = os.environ.get("ELASTICD_TEST_OUT")
    if path:
        torch.save(res, Path(path) / f"rank{rank}.pt")


if __name__ == "__main__":
    train()
