"""Helpers of tests/jobs/torchrun_tutorial.py, in a module of their own as tutorials split them: the model,
the data, and the DDP wrapping with DistributedDataParallel imported by name here, not in the script."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(20, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def dataset(n: int = 512) -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 20, generator=g)
    y = (x @ torch.randn(20, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


def wrap(model: nn.Module, device: torch.device) -> nn.Module:
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
