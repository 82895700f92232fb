"""A torchrun script configured by Hydra, shaped like pytorch/examples' minGPT-ddp `main.py`: `@hydra.main`
around the whole job, a config file next to the script, overrides as the script's arguments, dropout,
`clip_grad_norm_`, a DataLoader over a `DistributedSampler`, the model wrapped in DDP. Nothing of elasticd.

    torchrun --nproc_per_node 4 torchrun_hydra.py out=FINAL.pt info=PREFIX  # writes PREFIX{rank}.json [steps=N] [...]

Each rank records what it saw (its rank, the config Hydra gave it, the job name from `HydraConfig`, and
its first random draws before the script seeds), so a test can tell per-rank state from shared state.
"""

import json
import os
import random

import hydra
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def unseeded_draws() -> dict:
    # before the script seeds: a fresh process under torchrun draws from streams of its own
    return {"torch": torch.rand(2).tolist(), "python": random.random(), "numpy": float(np.random.rand())}


@hydra.main(version_base=None, config_path="hydra_conf", config_name="train")
def main(cfg: DictConfig) -> None:
    draws = unseeded_draws()
    dist.init_process_group(backend="gloo")
    rank = dist.get_rank()
    torch.manual_seed(cfg.seed)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(cfg.samples, cfg.model.width, generator=g)
    y = (x @ torch.randn(cfg.model.width, 4, generator=g)).argmax(dim=1)
    data = TensorDataset(x, y)
    model = nn.Sequential(nn.Linear(cfg.model.width, cfg.model.hidden), nn.GELU(), nn.Dropout(cfg.model.dropout),
                          nn.Linear(cfg.model.hidden, 4))
    model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    loader = DataLoader(data, batch_size=cfg.batch_size, sampler=DistributedSampler(data))
    done = 0
    for epoch in range(cfg.epochs):
        loader.sampler.set_epoch(epoch)
        for source, targets in loader:
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(source), targets).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_norm_clip)
            opt.step()
            done += 1
    info = {"rank": rank, "env_rank": os.environ["RANK"], "cfg": OmegaConf.to_container(cfg),
            "job": HydraConfig.get().job.name, "overrides": list(HydraConfig.get().overrides.task),
            "draws": draws, "steps": done}
    with open(f"{cfg.info}{rank}.json", "w") as f:
        json.dump(info, f)
    if rank == 0:
        torch.save(model.module.state_dict(), cfg.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
