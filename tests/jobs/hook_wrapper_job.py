"""A wrapper that registers a forward hook on a layer of the net it wraps, a method of its own that keeps
the layer's output in `self.hidden`, which its forward reads right after (byol-pytorch's NetWrapper, made
in its constructor as BYOL's mock forward makes it: before `ctx.replicate`, on each worker's own model).

What this job pins: `ctx.replicate` once moved a later worker's hook to the shared layer still bound to the
wrapper of its own model, set aside, while its forward read the shared wrapper's `hidden`: KeyError in every
later worker. Rank 0 writes the model and how many outputs each rank's hook kept.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import save_state

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = 6


class Wrapper(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net
        self.head = nn.Linear(16, 4)
        self.hidden: dict[torch.device, torch.Tensor] = {}
        self.kept = 0
        net[1].register_forward_hook(self._hook)

    def _hook(self, _module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        self.hidden[inputs[0].device] = output
        self.kept += 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hidden.clear()
        self.net(x)
        hidden = self.hidden[x.device]   # the KeyError before
        self.hidden.clear()
        return self.head(hidden)


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    net = Wrapper(nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3)))
    model, opt = ctx.replicate(net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    g = torch.Generator().manual_seed(ctx.rank)
    kept = 0
    for _ in ctx.steps(STEPS):
        x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
        before = getattr(model, "module", model).kept
        loss = F.cross_entropy(model(x), y)
        kept += getattr(model, "module", model).kept - before   # read before any hand-over: this pass's only
        opt.zero_grad()
        loss.backward()
        opt.step()
    counts = torch.zeros(dist.get_world_size())
    counts[ctx.rank] = kept
    dist.all_reduce(counts)
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT", extra={"kept": counts})


if __name__ == "__main__":
    train()
