"""A job whose second tracked object, a home-made LR scheduler, keeps a function in its state.

`LRScheduler.state_dict()` returns the object's `__dict__`, so the lambda goes with it; a snapshot holds
only plain data, so a resize must fail naming the scheduler instead of dropping it.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))


class RuleLR(torch.optim.lr_scheduler.LRScheduler):
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.rule = lambda epoch: 0.9**epoch
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [base * self.rule(self.last_epoch) for base in self.base_lrs]


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model, opt = ctx.replicate(*(lambda m: (m, torch.optim.SGD(m.parameters(), lr=0.1)))(nn.Linear(4, 2)))
    sched = RuleLR(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1))
    for _ in ctx.steps(8):
        loss = model(torch.randn(3, 4)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


if __name__ == "__main__":
    train()
