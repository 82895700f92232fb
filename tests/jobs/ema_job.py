"""A model average (EMA) the function builds itself and never registers, as DDP scripts keep one.

ELASTICD_TEST_EMA picks how: `averaged` — torch's `AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn)`
made after `ctx.replicate` (its `n_averaged` counter is state too); `copy` — `copy.deepcopy(model)` made
before `ctx.replicate` (timm's order: the EMA before the DDP wrap) and updated by hand, buffers included;
`module` — an `nn.Module` wrapper whose constructor deep-copies the model, made before `ctx.replicate` and
updated through its own method, as timm's `ModelEmaV2`; `tensors` — a dict of detached copies of the model's state (`{k: v.detach().clone() ...}`, floating-point
entries only) made after `ctx.replicate` and updated in place, the way many scripts keep an EMA by hand.
Each rank updates its own average every step, as each DDP process does.
A resize re-enters the function, which builds the average again from the current weights: it must get its
state back. Rank 0 writes the model and the average (`ema.` keys) to $ELASTICD_TEST_OUT.
"""

from __future__ import annotations

import copy
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import classification_data, save_state
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import DataLoader, DistributedSampler

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
DETERMINISTIC = os.environ.get("ELASTICD_TEST_DETERMINISTIC", "0") == "1"
VARIANT = os.environ.get("ELASTICD_TEST_EMA", "averaged")
STEPS = 20
DECAY = 0.8   # short memory, so that an average restarted at a resize is far from the true one by the end


class ModuleEma(nn.Module):
    """timm's `ModelEmaV2` shape: the copy is made inside a module's constructor and is a submodule of it."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        super().__init__()
        self.module = copy.deepcopy(model)
        self.decay = decay

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        for e, p in zip(self.module.state_dict().values(), model.state_dict().values(), strict=True):
            if e.is_floating_point():
                e.mul_(self.decay).add_(p, alpha=1 - self.decay)


@elasticd.elastic(workers=WORKERS, deterministic=DETERMINISTIC)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)).to(ctx.device)
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_INIT")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if VARIANT == "copy":
        ema = copy.deepcopy(model)
    if VARIANT == "module":
        ema = ModuleEma(model, DECAY)
    model, opt = ctx.replicate(model, opt)
    if VARIANT == "averaged":
        ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(DECAY), use_buffers=True)
    if VARIANT == "tensors":
        ema = {k: v.detach().clone() for k, v in model.state_dict().items() if v.is_floating_point()}
    ds = classification_data(31)
    sampler = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
    batches = ctx.batches(DataLoader(ds, batch_size=16, sampler=sampler))
    for _ in ctx.steps(STEPS):
        x, y = next(batches)
        loss = F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if VARIANT == "tensors":
            with torch.no_grad():
                for k, p in model.state_dict().items():
                    if k in ema:
                        ema[k].mul_(DECAY).add_(p, alpha=1 - DECAY)
        elif VARIANT == "copy":
            with torch.no_grad():
                for e, p in zip(ema.state_dict().values(), model.state_dict().values(), strict=True):
                    if e.is_floating_point():
                        e.mul_(DECAY).add_(p, alpha=1 - DECAY)
        elif VARIANT == "module":
            ema.update(model)
        else:
            ema.update_parameters(model)
    if ctx.rank == 0:
        average = ema.module if isinstance(ema, AveragedModel | ModuleEma) else ema
        held = average if isinstance(average, dict) else average.state_dict()
        extra = {f"ema.{k.removeprefix('module.')}": v.detach().cpu().clone() for k, v in held.items()}
        if isinstance(ema, AveragedModel):
            extra["ema.n_averaged"] = ema.n_averaged.detach().cpu().clone()
        save_state(model, "ELASTICD_TEST_OUT", extra=extra)


if __name__ == "__main__":
    train()
