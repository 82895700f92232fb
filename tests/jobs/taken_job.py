"""What a script keeps beside its model before the loop, which a resize must not lose or take again.

- `state`: a training-state dict holding the model and optimizer (carried their own way) beside the values
  its loop changes: a learning rate it decays by hand, a count of samples seen.
- `anchor` and `w0`: L2-SP's anchor, copies of the parameters the loop pulls them back towards; never
  changed by the loop, and under DDP the weights the job began with.
- `best`: the best weights so far, `copy.deepcopy(model.state_dict())` (an OrderedDict), replaced when a
  step does better.

A resize re-enters the function, which builds them again: the dict from its first values, the copies from
the model the resize restored. Each made the result differ from DDP's, exit 0. Rank 0 writes the model and
the best weights (`best.` keys) to $ELASTICD_TEST_OUT.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import classification_data, save_state
from torch.utils.data import DataLoader, DistributedSampler

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = 20


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = ctx.replicate(model, opt)
    inner = getattr(model, "module", model)   # DDP's wrapper under --ddp
    state = {"model": model, "opt": opt, "lr": 0.2, "seen": 0}
    anchor = [p.detach().clone() for p in inner[2].parameters()]
    w0 = inner[0].weight.detach().clone()
    best = copy.deepcopy(inner.state_dict())
    best_loss = float("inf")
    ds = classification_data(47)
    sampler = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
    batches = ctx.batches(DataLoader(ds, batch_size=16, sampler=sampler))
    for step in ctx.steps(STEPS):
        x, y = next(batches)
        loss = F.cross_entropy(state["model"](x), y)
        pull = ((inner[0].weight - w0) ** 2).sum() + sum(((p - a) ** 2).sum()
                                                         for p, a in zip(inner[2].parameters(), anchor, strict=True))
        opt.zero_grad()
        (loss + 0.5 * pull).backward()
        for group in state["opt"].param_groups:
            group["lr"] = state["lr"]
        state["lr"] *= 0.9
        state["seen"] += len(x)
        opt.step()
        mean = loss.detach().clone()
        ctx.all_reduce(mean)   # every rank picks the same best step, as a DDP script must
        if step in (3, 7) and mean.item() < best_loss:   # before the resizes the test asks for
            best_loss = mean.item()
            best = copy.deepcopy(inner.state_dict())
    if ctx.rank == 0:
        extra = {f"best.{k}": v.clone() for k, v in best.items()}
        extra.update({"state.seen": torch.tensor(float(state["seen"])), "state.lr": torch.tensor(state["lr"])})
        save_state(model, "ELASTICD_TEST_OUT", extra=extra)


if __name__ == "__main__":
    train()
