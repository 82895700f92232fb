"""GPU job (tests/agent/test_cuda.py): replicated model, dropout, per-rank private state and CUDA random draws
on `ctx.device`, optionally under a side stream. Runs on CPU too (the CPU reference of its loss trace).

Each rank appends "step loss noise private" to $ELASTICD_TEST_LOG/rank<r>.log (floats as `repr`, so
traces compare bitwise), and at the end writes its agent's peak device memory and private-state swap
counters to $ELASTICD_TEST_LOG/peak<r>.json; rank 0 saves the model to $ELASTICD_TEST_OUT. In every
step each worker checks that its thread's current CUDA device is its agent's (`torch.cuda.set_device`
is per thread).

Env: ELASTICD_TEST_WORKERS (4), ELASTICD_TEST_STEPS (12), ELASTICD_TEST_DETERMINISTIC (0/1),
ELASTICD_TEST_DROPOUT (0.3), ELASTICD_TEST_STREAM (1: compute under `torch.cuda.stream(s)`),
ELASTICD_TEST_PRIVATE_MB (32: each rank's private tensor, which --device-memory makes swap),
ELASTICD_TEST_MEMORY_HISTORY (a path: rank 0 dumps its agent's CUDA allocation history there, with the
stack of every allocation, for `torch.cuda.memory._snapshot` readers; recording starts at import).
"""

from __future__ import annotations

import contextlib
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

import elasticd
from elasticd.agent.slicer.context import private_stats as stats

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = int(os.environ.get("ELASTICD_TEST_STEPS", "12"))
DETERMINISTIC = os.environ.get("ELASTICD_TEST_DETERMINISTIC", "0") == "1"
DROPOUT = float(os.environ.get("ELASTICD_TEST_DROPOUT", "0.3"))
STREAM = os.environ.get("ELASTICD_TEST_STREAM", "0") == "1"
PRIVATE_MB = int(os.environ.get("ELASTICD_TEST_PRIVATE_MB", "32"))
BATCH = 16
NOISE_SEED = 1000  # + rank: every rank's CUDA stream differs, so a stream shared between workers shows
HISTORY = os.environ.get("ELASTICD_TEST_MEMORY_HISTORY")
if HISTORY:
    torch.cuda.memory._record_memory_history(max_entries=500_000)


@elasticd.elastic(workers=WORKERS, deterministic=DETERMINISTIC)
def train(ctx) -> None:
    dev = ctx.device
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Dropout(DROPOUT), nn.Linear(256, 8)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = ctx.replicate(model, opt)
    memory = ctx.private(torch.zeros(PRIVATE_MB * 2**20 // 4, device=dev))
    if cuda:
        torch.cuda.manual_seed(NOISE_SEED + ctx.rank)  # this worker's CUDA stream only
    g = torch.Generator().manual_seed(1)
    x_all = torch.randn(STEPS * WORKERS * BATCH, 64, generator=g)
    y_all = torch.randn(STEPS * WORKERS * BATCH, 8, generator=g)
    side = torch.cuda.Stream(dev) if cuda and STREAM else None
    log_dir = os.environ["ELASTICD_TEST_LOG"]
    for step in ctx.steps(STEPS):
        if cuda:
            assert torch.cuda.current_device() == dev.index, \
                f"rank {ctx.rank} runs on cuda:{torch.cuda.current_device()}, its agent on {dev}"
        lo = (step * WORKERS + ctx.rank) * BATCH
        x, y = x_all[lo:lo + BATCH].to(dev), y_all[lo:lo + BATCH].to(dev)
        if side is not None:
            side.wait_stream(torch.cuda.current_stream(dev))  # the batch was copied on the default stream
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            noise = torch.rand(BATCH, 8, device=dev) if cuda else torch.zeros(BATCH, 8)
            memory.mul_(0.5).add_(x.mean())
            loss = F.mse_loss(model(x) + memory[:8], y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            row = f"{step} {loss.item()!r} {noise.sum().item()!r} {memory[0].item()!r}\n"
        with open(os.path.join(log_dir, f"rank{ctx.rank}.log"), "a") as f:
            f.write(row)
    peak = torch.cuda.max_memory_allocated(dev) if cuda else 0
    with open(os.path.join(log_dir, f"peak{ctx.rank}.json"), "w") as f:
        json.dump({"max_memory_allocated": peak, "swap": stats(ctx).as_dict()}, f)
    if HISTORY and ctx.rank == 0:
        torch.cuda.memory._dump_snapshot(HISTORY)
    if ctx.rank == 0:
        torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, os.environ["ELASTICD_TEST_OUT"])


if __name__ == "__main__":
    train()
