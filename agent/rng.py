"""Per-worker random-number streams.

Each logical worker must draw from its own streams, exactly as it would in its own process: the torch
CPU generator, the CUDA generator of its device, Python's `random` and numpy's global state are
process-wide, so the agent saves the outgoing worker's states and restores the incoming worker's at
every hand-off. A fresh worker starts from the states the agent process had at start-up (what a
freshly started DDP process would have).
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class RngState:
    torch_cpu: torch.Tensor
    python: Any
    numpy: Any | None = None
    cuda: torch.Tensor | None = None

    def to_dict(self) -> dict[str, Any]:
        """Plain containers for snapshots (resize, checkpoints)."""
        return {"torch_cpu": self.torch_cpu.clone(), "python": self.python, "numpy": self.numpy,
                "cuda": None if self.cuda is None else self.cuda.clone()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RngState:
        return cls(torch_cpu=d["torch_cpu"], python=d["python"], numpy=d.get("numpy"), cuda=d.get("cuda"))


def _numpy_random() -> Any | None:
    # Only touch numpy if someone imported it; importing it here would cost every switch nothing but
    # would make the agent pay an import the user never asked for.
    np = sys.modules.get("numpy")
    return None if np is None else np.random


def capture(cuda_device: torch.device | None = None) -> RngState:
    np_random = _numpy_random()
    return RngState(
        torch_cpu=torch.get_rng_state(),
        python=random.getstate(),
        numpy=None if np_random is None else np_random.get_state(),
        cuda=torch.cuda.get_rng_state(cuda_device) if cuda_device is not None else None,
    )


def restore(state: RngState, cuda_device: torch.device | None = None) -> None:
    torch.set_rng_state(state.torch_cpu)
    random.setstate(state.python)
    np_random = _numpy_random()
    if np_random is not None and state.numpy is not None:
        np_random.set_state(state.numpy)
    if cuda_device is not None and state.cuda is not None:
        torch.cuda.set_rng_state(state.cuda, cuda_device)
