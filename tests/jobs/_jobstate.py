"""What the equivalence jobs share: how logical rank 0 writes a model's state for a test to compare.

Jobs import it by name: both runners (agent/script.py, agent/ddp_reference.py) put the script's folder first
on sys.path, as `python script.py` does.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn


def save_state(model: nn.Module, env: str) -> None:
    """Logical rank 0 writes {name: tensor} (params and buffers, no DDP `module.` prefix)."""
    path = os.environ.get(env)
    if path:
        torch.save({k.removeprefix("module."): v.detach().cpu().clone() for k, v in model.state_dict().items()},
                   path)
