"""A GAN step: D on real and on detached fakes with one backward (as SNGAN's loops take it; pytorch/examples'
DCGAN takes one each), D's step, then G's loss through the updated D and G's step. Both nets have
BatchNorm, D's last layers are spectral-normalised, both go through ctx.replicate.

- D runs forward twice before its backward (a hand-over), and spectral norm's power iteration reads and
  updates its vectors in each forward. Under DDP every rank's k-th forward starts from rank 0's vectors at
  its k-th forward; later hosted workers read them as before the first worker's last forward: 7e-2 from
  DDP, exit 0.
- G's forward comes before D's step and its backward after. Another hosted worker's forward of G in
  between (at D's step, where a worker hands over) changed the shared BatchNorm statistics in place, and
  G's backward refused to run ("modified by an inplace operation"); so did a flush broadcasting them.
- Batches come as the DCGAN's port takes them: an iterator made at each epoch's first step (4 steps an
  epoch), which a function re-entered mid-epoch did not make again (UnboundLocalError at `next(batches)`
  after every resize). Another loader is iterated before it at each epoch's first step, so the training
  iterator made again must resume its own loader's state, not the first one saved.

Rank 0 writes both nets, buffers included, and every rank's losses.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import save_with_every_ranks
from torch.nn.utils.parametrizations import spectral_norm
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = 9
NZ = 4


# No bias before a BatchNorm, as the DCGAN's layers: its gradient is round-off, which Adam makes a full step.
def generator() -> nn.Module:
    return nn.Sequential(nn.Linear(NZ, 16, bias=False), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 8), nn.Tanh())


def discriminator() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16, bias=False), nn.BatchNorm1d(16), nn.LeakyReLU(0.2),
                         spectral_norm(nn.Linear(16, 16)), nn.LeakyReLU(0.2), spectral_norm(nn.Linear(16, 1)),
                         nn.Sigmoid())


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    net_g, net_d = generator(), discriminator()
    opt_g = torch.optim.Adam(net_g.parameters(), lr=0.01, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=0.01, betas=(0.5, 0.999))
    net_g, opt_g = ctx.replicate(net_g, opt_g)
    net_d, opt_d = ctx.replicate(net_d, opt_d)
    data = TensorDataset(torch.tanh(torch.randn(64, 8, generator=torch.Generator().manual_seed(1)) + 1))
    sampler = DistributedSampler(data, num_replicas=ctx.world_size, rank=ctx.rank, seed=2)
    loader = DataLoader(data, batch_size=4, sampler=sampler)   # 4 steps an epoch on 4 workers
    probes = DataLoader(TensorDataset(torch.randn(6, 8, generator=torch.Generator().manual_seed(3))), batch_size=4,
                        shuffle=True)
    g = torch.Generator().manual_seed(ctx.rank)
    losses = []
    for step in ctx.steps(STEPS):
        epoch, i = divmod(step, len(loader))
        if i == 0:
            # a pass over another loader first: the function iterates it before the training one
            losses.append(sum(float(v.sum()) for (v,) in probes))
            sampler.set_epoch(epoch)
            batches = iter(loader)
        (real,) = next(batches)
        net_d.zero_grad()
        fake = net_g(torch.randn(len(real), NZ, generator=g))
        err_real = F.binary_cross_entropy(net_d(real).squeeze(1), torch.ones(len(real)))
        err_fake = F.binary_cross_entropy(net_d(fake.detach()).squeeze(1), torch.zeros(len(real)))
        (err_real + err_fake).backward()   # two forwards of D before a hand-over
        opt_d.step()
        net_g.zero_grad()
        err_g = F.binary_cross_entropy(net_d(fake).squeeze(1), torch.ones(len(real)))
        err_g.backward()
        opt_g.step()
        losses.append(err_g.item())
    both = nn.ModuleDict({"G": getattr(net_g, "module", net_g), "D": getattr(net_d, "module", net_d)})
    save_with_every_ranks(ctx, both, losses, "losses")


if __name__ == "__main__":
    train()
