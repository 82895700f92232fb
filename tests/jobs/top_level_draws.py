"""Draws from torch, `random` and numpy at the script's top level, unseeded, which runs once per agent
process (once per process under DDP); each rank writes what its process drew to {DRAWS_OUT}{rank}.json."""

import json
import os
import random

import numpy as np
import torch

import elasticd

TOP = {"torch": torch.rand(1).item(), "python": random.random(), "numpy": float(np.random.rand())}


@elasticd.elastic(workers=4)
def train(ctx) -> None:
    with open(f"{os.environ['DRAWS_OUT']}{ctx.rank}.json", "w") as f:
        json.dump(TOP, f)
