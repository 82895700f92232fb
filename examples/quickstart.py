import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import elasticd

g = torch.Generator().manual_seed(0)         # the same data in every process
ds = TensorDataset(torch.randn(4096, 32, generator=g), torch.randint(0, 4, (4096,), generator=g))

@elasticd.elastic(workers=8)                 # N logical workers; deterministic=False by default
def train(ctx):                              # ctx.rank, ctx.world_size (=N), ctx.device, ctx.step
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4)).to(ctx.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = ctx.replicate(model, opt)   # one shared copy per device, DDP-style averaging
    sampler = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
    batches = ctx.batches(DataLoader(ds, batch_size=32, sampler=sampler))  # resumable position
    for step in ctx.steps(150):              # resumable step counter; each step is a resize point
        x, y = next(batches)
        loss = F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
        opt.zero_grad()
        loss.backward()                      # end of backward = context-switch point
        ctx.clip_grad_norm_(1.0)             # on the averaged gradient, once
        opt.step()
        ctx.log(loss=loss.item())            # shown by `elasticd status` / `logs`
        if ctx.rank == 0 and step % 50 == 0:
            print(f"step {step} loss {loss.item():.4f}")
    if ctx.rank == 0:
        print(f"final loss {loss.item():.6f}")

if __name__ == "__main__":
    train()                                  # standalone: all N logical workers in this process
