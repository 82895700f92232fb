"""Resize job: trains while being shrunk and grown; records what every logical rank consumed.

Each rank appends "step idx idx ..." to $ELASTICD_TEST_LOG/rank<r>.log as it consumes a batch, and the
step to done<r>.log once its optimizer step is taken, so a test can check that no step ran twice or not
at all and no sample was skipped or repeated, and which steps a recovery computed again. A private
counter (samples seen) must survive every resize. Deterministic mode is switched by env.

Driven from outside (tests/elasticd/daemon/test_resize_daemon.py), the job can be paced: while $ELASTICD_TEST_RELEASE
names a file that does not exist yet, every step also sleeps $ELASTICD_TEST_PACE_S, so a test can scale
it several times while it is surely still training. The sleep changes when steps happen, never what
they compute. While $ELASTICD_TEST_HOLD names a file that exists, every step (only step
$ELASTICD_TEST_HOLD_AT, if set) waits at its start: a test holds the job short of a step boundary, to line
up what happens at that boundary. With ELASTICD_TEST_UNSAVABLE=1 it holds a state no snapshot can carry
(tests/jobs/_jobstate.py `Unsavable`), so its agents refuse every resize and train on.

Faults for the watchdog (tests/elasticd/test_run_recovery.py): at step $ELASTICD_TEST_SLOW_AT every rank
spends $ELASTICD_TEST_SLOW_S seconds before its step (an evaluation: slow, no one waits); at step
$ELASTICD_TEST_HANG_AT rank $ELASTICD_TEST_HANG_RANK blocks for good (a deadlock in the script, a wedged
kernel), once: the file $ELASTICD_TEST_HANG_ONCE marks that it did, so the recovered job goes on.
"""

from __future__ import annotations

import os
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import unsavable
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = int(os.environ.get("ELASTICD_TEST_STEPS", "40"))
DETERMINISTIC = os.environ.get("ELASTICD_TEST_DETERMINISTIC", "0") == "1"
PACE_S = float(os.environ.get("ELASTICD_TEST_PACE_S", "0.05"))


HOLD_AT = int(os.environ.get("ELASTICD_TEST_HOLD_AT", "-1"))
SLOW_AT = int(os.environ.get("ELASTICD_TEST_SLOW_AT", "-1"))
HANG_AT = int(os.environ.get("ELASTICD_TEST_HANG_AT", "-1"))


def faults(step: int, rank: int) -> None:
    if step == SLOW_AT:
        time.sleep(float(os.environ["ELASTICD_TEST_SLOW_S"]))
    once = os.environ.get("ELASTICD_TEST_HANG_ONCE", "")
    if step == HANG_AT and rank == int(os.environ["ELASTICD_TEST_HANG_RANK"]) and not os.path.exists(once):
        open(once, "w").close()
        threading.Event().wait()


def paced(step: int) -> None:
    release = os.environ.get("ELASTICD_TEST_RELEASE")
    if release and not os.path.exists(release):
        time.sleep(PACE_S)
    hold = os.environ.get("ELASTICD_TEST_HOLD")
    while hold and HOLD_AT in (-1, step) and os.path.exists(hold):
        time.sleep(0.01)


@elasticd.elastic(workers=WORKERS, deterministic=DETERMINISTIC)
def train(ctx) -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(400, 12, generator=g)
    y = (x @ torch.randn(12, 3, generator=g)).argmax(dim=1)
    ds = TensorDataset(x, y, torch.arange(400))
    # bias=False before BatchNorm: BN cancels a bias, leaving it a round-off-only gradient that AdamW
    # would turn into lr-sized steps under any reordering of the sum (docs/architecture.md).
    model = nn.Sequential(nn.Linear(12, 24, bias=False), nn.BatchNorm1d(24), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(24, 3)).to(ctx.device)  # a no-op on CPU; tests/agent/test_cuda.py runs it on a GPU
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.7)
    model, opt, sched = ctx.replicate(model, opt, sched)
    seen = ctx.private(torch.zeros(1, dtype=torch.int64))
    sampler = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=3)
    batches = ctx.batches(DataLoader(ds, batch_size=10, sampler=sampler))  # 10 steps per epoch
    log_dir = os.environ["ELASTICD_TEST_LOG"]
    warmup = unsavable()  # noqa: F841 - held, never used
    for step in ctx.steps(STEPS):
        paced(step)
        faults(step, ctx.rank)
        xb, yb, idx = next(batches)
        with open(os.path.join(log_dir, f"rank{ctx.rank}.log"), "a") as f:
            f.write(f"{step} {' '.join(map(str, idx.tolist()))}\n")
        seen += len(idx)
        loss = F.cross_entropy(model(xb.to(ctx.device)), yb.to(ctx.device))
        opt.zero_grad()
        loss.backward()
        ctx.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        ctx.log(loss=loss.item())
        with open(os.path.join(log_dir, f"done{ctx.rank}.log"), "a") as f:
            f.write(f"{step}\n")
    torch.save(seen.clone(), os.path.join(log_dir, f"seen{ctx.rank}.pt"))
    if ctx.rank == 0:
        torch.save({k: v.detach().cpu().clone() for k, v in model.state_dict().items()}, os.environ["ELASTICD_TEST_OUT"])


if __name__ == "__main__":
    train()
