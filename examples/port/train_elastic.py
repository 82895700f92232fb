"""train_ddp.py ported to elasticd: `elasticd run train_elastic.py --devices 2 --scale-at 10:1`."""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import elasticd

EPOCHS = 2


@elasticd.elastic(workers=4)
def main(ctx):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    ds = TensorDataset(torch.randn(2048, 32, generator=g), torch.randint(0, 4, (2048,), generator=g))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=EPOCHS * 16)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(ds, batch_size=32, sampler=sampler)
    for step in ctx.steps(EPOCHS * len(loader)):
        if step % len(loader) == 0:
            sampler.set_epoch(step // len(loader))
            batches = iter(loader)
        x, y = next(batches)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if rank == 0 and step % 8 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
    if rank == 0:
        torch.save(model.module.state_dict(), sys.argv[1] if len(sys.argv) > 1 else "model.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
