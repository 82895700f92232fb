"""Idiom job: torch's own gradient clipping on a replicated model, called by two different names.

`torch.nn.utils.clip_grad_norm_` (module attribute), `clip_grad_value_`, `get_total_norm` and
`clip_grads_with_norm_` (names imported into this module) must clip the averaged gradient once per step,
as under DDP, and every rank must get the same total norms back.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import assert_same_on_every_rank, classification_data, save_state
from torch.nn.utils import clip_grad_value_, clip_grads_with_norm_, get_total_norm
from torch.utils.data import DataLoader, DistributedSampler

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = 24
BATCH = 16
MAX_NORM = 0.5
CLIP_VALUE = 0.05


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    model = model.to(ctx.device)
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_INIT")
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    model, opt = ctx.replicate(model, opt)
    ds = classification_data(1234)
    sampler = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
    batches = ctx.batches(DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=0))
    norms: list[float] = []
    for _ in ctx.steps(STEPS):
        x, y = next(batches)
        loss = F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        clip_grad_value_(model.parameters(), CLIP_VALUE)
        # torch's two halves of clip_grad_norm_, over the .grad tensors themselves
        total = get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
        clip_grads_with_norm_(model.parameters(), MAX_NORM / 2, total)
        opt.step()
        norms += [norm.item(), total.item()]
        ctx.log(loss=loss.item(), grad_norm=norm.item())
    if not any(n > MAX_NORM for n in norms):
        raise AssertionError(f"the gradient norm never exceeded {MAX_NORM}: clipping was not exercised")
    assert_same_on_every_rank(ctx, norms, "the total norms clip_grad_norm_ and get_total_norm returned")
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT")


if __name__ == "__main__":
    train()
