"""A momentum-contrast step (MoCo's shape): a query encoder trained by SGD built over model.parameters(), a
key encoder that is a frozen copy updated by `param_k.data = param_k.data * m + param_q.data * (1 - m)` in
the forward, keys from a batch shuffled across ranks (an all_gather and a broadcast inside the forward,
BatchNorm in both encoders) and a queue of keys held in buffers written in the forward.

Before: ctx.replicate refused the optimizer ("parameters that are not the model's": the key encoder's are
frozen, not foreign); then each hosted worker made the momentum update again on the one shared key encoder,
1.7 from DDP, exit 0. Rank 0 writes the model, buffers (the queue) included.
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
STEPS = 9


@torch.no_grad()
def gathered(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return torch.cat(out)


def encoder() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 8))


class Momentum(nn.Module):
    def __init__(self, queue: int = 32, m: float = 0.9) -> None:
        super().__init__()
        self.m = m
        self.encoder_q, self.encoder_k = encoder(), encoder()
        for pq, pk in zip(self.encoder_q.parameters(), self.encoder_k.parameters(), strict=True):
            pk.data.copy_(pq.data)
            pk.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(8, queue), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    def forward(self, im_q: torch.Tensor, im_k: torch.Tensor) -> torch.Tensor:
        q = F.normalize(self.encoder_q(im_q), dim=1)
        with torch.no_grad():
            for pq, pk in zip(self.encoder_q.parameters(), self.encoder_k.parameters(), strict=True):
                pk.data = pk.data * self.m + pq.data * (1.0 - self.m)
            order = torch.randperm(len(im_k) * dist.get_world_size())
            dist.broadcast(order, 0)
            mine = order.view(dist.get_world_size(), -1)[dist.get_rank()]
            k = F.normalize(self.encoder_k(gathered(im_k)[mine]), dim=1)
            k = gathered(k)[torch.argsort(order).view(dist.get_world_size(), -1)[dist.get_rank()]]
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ self.queue.clone()], 1) / 0.2
        with torch.no_grad():
            keys, ptr = gathered(k), int(self.queue_ptr)
            self.queue[:, ptr:ptr + len(keys)] = keys.T
            self.queue_ptr[0] = (ptr + len(keys)) % self.queue.shape[1]
        return F.cross_entropy(logits, torch.zeros(len(logits), dtype=torch.long))


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    net = Momentum()
    model, opt = ctx.replicate(net, torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4))
    g = torch.Generator().manual_seed(ctx.rank)
    for _ in ctx.steps(STEPS):
        x = torch.randn(4, 16, generator=g)
        loss = model(x + 0.1 * torch.randn(4, 16, generator=g), x + 0.1 * torch.randn(4, 16, generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT")


if __name__ == "__main__":
    train()
