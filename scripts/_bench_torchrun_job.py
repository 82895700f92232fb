"""The job of scripts/bench_torchrun_mode.py: a DDP script written for torchrun, nothing of elasticd in it.

Tutorial style (env ranks, `init_process_group`, `DistributedDataParallel`, `DistributedSampler.set_epoch`,
`destroy_process_group`), an MLP on synthetic data. Rank 0 stamps every step start (and the end), so the
benchmark times steps, never start-up, and writes its stamps and a parameter checksum as JSON:

    torchrun --nproc_per_node 4 _bench_torchrun_job.py --out R.json [--steps S --width W --batch B]
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def main(args):
    dist.init_process_group(backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(256, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                              nn.Linear(args.width, 10)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    n = 8 * args.batch * world
    dataset = TensorDataset(torch.randn(n, 256, generator=g), torch.randint(0, 10, (n,), generator=g))
    sampler = DistributedSampler(dataset)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler)
    stamps, epoch = [], 0
    while len(stamps) < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            stamps.append(time.perf_counter())
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            if len(stamps) == args.steps:
                break
        epoch += 1
    stamps.append(time.perf_counter())
    checksum = sum(p.double().sum().item() for p in model.parameters())
    dist.destroy_process_group()
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"stamps": stamps, "checksum": checksum}, f)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32)
    main(parser.parse_args())
