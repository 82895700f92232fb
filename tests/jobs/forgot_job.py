"""A minGPT-style trainer that registers nothing but its step loop.

The model is wrapped in torch's own DistributedDataParallel; the optimizer, the LR scheduler and the
GradScaler are plain objects never passed to ctx.replicate / ctx.private; the data comes from a plain
DataLoader iterator taken before the loop (`it = iter(loader)`, `next(it)`), re-created with
`sampler.set_epoch(...)` when it runs out. A resize must carry all of it as DDP would never lose it.

Rank 0 writes the model's state plus the final LR and loss scale to $ELASTICD_TEST_OUT; with
$ELASTICD_TEST_LOG set, every rank appends "step hosted-ranks idx idx ..." per step to rank<r>.log there, and
`ctx.step` as the function starts, each time it does, to starts<r>.log; and it rewrites config.txt (with
`open`) and notes.txt (with `Path.write_text`) there.
With ELASTICD_TEST_LOOP=for, `ctx.steps` drives from inside the trainer's own `for batch in loader` loop,
whose epoch counter is a plain variable (same data and random draws as the default loop under DDP).
With ELASTICD_TEST_UNSAVABLE=1 the function also holds an object whose state_dict() a snapshot cannot hold
(a function in it): every resize is refused and the job must train on exactly as DDP does.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import unsavable
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = int(os.environ.get("ELASTICD_TEST_STEPS", "20"))
LOOP = os.environ.get("ELASTICD_TEST_LOOP", "next")


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(512, 10, generator=g)
    y = (x @ torch.randn(10, 4, generator=g)).argmax(dim=1)
    ds = TensorDataset(x, y, torch.arange(512))
    model = DDP(nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    sampler = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)  # 8 batches per epoch and rank
    log_dir = os.environ.get("ELASTICD_TEST_LOG")
    warmup = unsavable()  # noqa: F841 - held, never used
    if log_dir:   # what the function's first lines see: the step it starts (or resumes) at
        with open(os.path.join(log_dir, f"starts{ctx.rank}.log"), "a") as f:
            f.write(f"{ctx.step}\n")
        with open(os.path.join(log_dir, "config.txt"), "w") as f:   # emptied again at a resize: said so
            f.write("lr=1e-2\n")
        Path(log_dir, "notes.txt").write_text("started\n")          # the same through pathlib

    def one_step(step: int, batch: list[torch.Tensor]) -> None:
        xb, yb, idx = batch
        if log_dir:
            with open(os.path.join(log_dir, f"rank{ctx.rank}.log"), "a") as f:
                hosted = len(getattr(ctx, "local_ranks", [ctx.rank]))
                f.write(f"{step} {hosted} {' '.join(map(str, idx.tolist()))}\n")
        loss = F.cross_entropy(model(xb), yb)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()

    if LOOP == "next":
        it = iter(loader)
        for step in ctx.steps(STEPS):
            try:
                batch = next(it)
            except StopIteration:
                sampler.set_epoch(step // len(loader))
                it = iter(loader)
                batch = next(it)
            one_step(step, batch)
    else:
        steps = ctx.steps(STEPS)
        for epoch in itertools.count():
            sampler.set_epoch(epoch)
            for batch in loader:
                step = next(steps, None)
                if step is None:
                    break
                one_step(step, batch)
            if step is None:
                break

    if ctx.rank == 0 and os.environ.get("ELASTICD_TEST_OUT"):
        state = {k.removeprefix("module."): v.detach().clone() for k, v in model.state_dict().items()}
        state["lr"] = torch.tensor(sched.get_last_lr()[0], dtype=torch.float64)
        state["scale"] = torch.tensor(float(scaler.get_scale()), dtype=torch.float64)
        torch.save(state, os.environ["ELASTICD_TEST_OUT"])


if __name__ == "__main__":
    train()
