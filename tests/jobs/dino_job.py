"""A self-distillation step (DINO's shape, facebookresearch/dino main_dino.py): a teacher built as a second
network that loads the student's weights and follows it by `param_k.data.mul_(m).add_(...)`, a loss module
whose `center` buffer the loop rebinds after an all_reduce, numpy schedules written into the replicated
optimizer's param_groups, per-parameter clipping through `p.grad.data` (DINO's `clip_gradients`) and the
last layer's gradients dropped for the first epoch (`p.grad = None`). Float64: AdamW and the clipping
threshold turn fp32 round-off into differences that say nothing about the runtime.

What this job pins, each once a defect: the clipping refused (a write through a replicated gradient's `.data`); with it
allowed, the first resize failed loading its own snapshot (a numpy float in the optimizer's param_groups);
past that, the resumed function rebuilt the teacher from the restored student and the center from zeros,
0.98 from DDP, exit 0. Rank 0 writes the student, the teacher (`teacher.`) and the center.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import save_state

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS, PER_EPOCH = 9, 3


def network() -> nn.Module:
    torch.manual_seed(0)   # DINO builds both from the same code; the teacher then loads the student's weights
    net = nn.Sequential()
    net.add_module("backbone", nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 16)))
    net.add_module("last_layer", nn.Linear(16, 12))
    return net.double()


class Centering(nn.Module):
    def __init__(self, dim: int, m: float = 0.9) -> None:
        super().__init__()
        self.m = m
        self.register_buffer("center", torch.zeros(1, dim, dtype=torch.float64))

    def forward(self, student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
        t = F.softmax((teacher - self.center) / 0.04, dim=-1).detach()
        loss = torch.sum(-t * F.log_softmax(student / 0.1, dim=-1), dim=-1).mean()
        with torch.no_grad():
            batch_center = teacher.sum(0, keepdim=True)
            dist.all_reduce(batch_center)
            self.center = self.center * self.m + batch_center / (len(teacher) * dist.get_world_size()) * (1 - self.m)
        return loss


def clip_each(model: nn.Module, clip: float) -> list[float]:
    norms = []
    for p in model.parameters():
        if p.grad is not None:
            norm = p.grad.data.norm(2)
            norms.append(norm.item())
            coef = clip / (norm + 1e-6)
            if coef < 1:
                p.grad.data.mul_(coef)
    return norms


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    student, teacher = network(), network()
    teacher.load_state_dict(student.state_dict())
    for p in teacher.parameters():
        p.requires_grad = False
    centering = Centering(12)
    decayed = [p for n, p in student.named_parameters() if not n.endswith(".bias")]
    plain = [p for n, p in student.named_parameters() if n.endswith(".bias")]
    opt = torch.optim.AdamW([{"params": decayed}, {"params": plain, "weight_decay": 0.0}])
    model, opt = ctx.replicate(student, opt)
    lr = np.linspace(1e-2, 1e-3, STEPS)
    wd = np.linspace(0.04, 0.4, STEPS)
    momentum = np.linspace(0.9, 1.0, STEPS)
    g = torch.Generator().manual_seed(ctx.rank)
    seen: list[float] = []
    for it in ctx.steps(STEPS):
        for i, group in enumerate(opt.param_groups):
            group["lr"] = lr[it]
            if i == 0:
                group["weight_decay"] = wd[it]
        x = torch.randn(4, 8, generator=g, dtype=torch.float64)
        views = [x + 0.1 * torch.randn(4, 8, generator=g, dtype=torch.float64) for _ in range(3)]
        loss = centering(model(torch.cat(views)), teacher(torch.cat(views[:2])).repeat(2, 1)[: 3 * 4])
        opt.zero_grad()
        loss.backward()
        norms = clip_each(model, 0.05)
        if it >= PER_EPOCH:
            # Not before: the first worker's `p.grad = None` below is made once for the device, and a later
            # worker's clip_each runs after it and sees no last-layer gradient where its DDP rank sees one.
            seen += norms
        if it < PER_EPOCH:
            for n, p in model.named_parameters():
                if "last_layer" in n:
                    p.grad = None
        opt.step()
        with torch.no_grad():
            for param_q, param_k in zip(model.parameters(), teacher.parameters(), strict=True):
                param_k.data.mul_(momentum[it]).add_((1 - momentum[it]) * param_q.detach().data)
    # Every DDP rank reads the norms of the average before clipping: so must every hosted worker.
    norms = torch.tensor(seen, dtype=torch.float64)
    low, high = norms.clone(), norms.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    if not torch.equal(low, high):
        raise RuntimeError(f"the ranks read different gradient norms before clipping: {(high - low).max().item()}")
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT", extra={
            **{f"teacher.{k}": v.detach().clone() for k, v in teacher.state_dict().items()},
            "center": centering.center.clone(), "clipped": torch.tensor(float(sum(n > 0.05 for n in seen)))})


if __name__ == "__main__":
    train()
