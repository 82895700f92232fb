"""What the equivalence jobs share: their classification data, and how logical rank 0 writes a model's state
for a test to compare.

Jobs import it by name: both runners (agent/script.py, agent/ddp_reference.py) put the script's folder first
on sys.path, as `python script.py` does.
"""

from __future__ import annotations

import os

import torch
import torch.distributed
import torch.nn as nn
from torch.utils.data import TensorDataset


def classification_data(seed: int) -> TensorDataset:
    """512 samples of 16 features in 4 linearly separable classes; the seed tells the jobs' data apart."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(dim=1)
    return TensorDataset(x, y)


class Unsavable:
    """A user's stateful helper whose state_dict() holds a function, which no snapshot can carry: held by a
    job's function (ELASTICD_TEST_UNSAVABLE=1), it makes its agents refuse every resize."""

    def __init__(self) -> None:
        self.rule = lambda step: min(1.0, (step + 1) / 4)

    def state_dict(self) -> dict:
        return {"rule": self.rule}

    def load_state_dict(self, state: dict) -> None:
        self.rule = state["rule"]


def unsavable() -> Unsavable | None:
    return Unsavable() if os.environ.get("ELASTICD_TEST_UNSAVABLE") else None


def save_state(model: nn.Module, env: str, extra: dict[str, torch.Tensor] | None = None) -> None:
    """Logical rank 0 writes {name: tensor} (params and buffers, no DDP `module.` prefix, then `extra`)."""
    path = os.environ.get(env)
    if path:
        state = {k.removeprefix("module."): v.detach().cpu().clone() for k, v in model.state_dict().items()}
        torch.save({**state, **(extra or {})}, path)


def save_with_every_ranks(ctx, model: nn.Module, values: list[float], name: str) -> None:
    """Gather every rank's `values` (one per step), then logical rank 0 writes the model and them (ranks x
    steps, under `name`) to $ELASTICD_TEST_OUT."""
    every = [torch.zeros(len(values)) for _ in range(ctx.world_size)]
    torch.distributed.all_gather(every, torch.tensor(values))
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_OUT", extra={name: torch.stack(every)})


def assert_same_on_every_rank(ctx, values: list[float], what: str) -> None:
    """Raise unless every rank recorded exactly the same values (as every DDP rank does).

    One max and one min all-reduce at the end of the run, so the check adds no collective inside the
    training loop (which would change where workers hand over, and could hide a bug the job looks for).
    """
    mine = torch.tensor(values, dtype=torch.float64)
    hi, lo = mine.clone(), mine.clone()
    ctx.all_reduce(hi, op="max")
    ctx.all_reduce(lo, op="min")
    if not torch.equal(hi, lo):
        raise AssertionError(f"rank {ctx.rank}: {what} differs between ranks: max {hi.tolist()} min {lo.tolist()}")
