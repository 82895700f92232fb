"""Each rank records its first random draws, from torch, `random` and numpy, before anything in the
function seeds. UNSEEDED_TOP=seed seeds all three once at the top of the script, which DDP runs once per
process (so every rank then draws the same numbers); unset, nothing seeds them (so under DDP every rank
draws its own). UNSEEDED_OUT is where rank r writes {UNSEEDED_OUT}{r}.json."""

import json
import os
import random

import numpy as np
import torch

import elasticd

if os.environ.get("UNSEEDED_TOP") == "seed":
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)


@elasticd.elastic(workers=4)
def train(ctx) -> None:
    draws = {"torch": torch.rand(2).tolist(), "python": random.random(), "numpy": float(np.random.rand())}
    ctx.barrier()   # a hand-over between every draw and the next rank's
    draws["torch_after"] = torch.rand(1).item()
    with open(f"{os.environ['UNSEEDED_OUT']}{ctx.rank}.json", "w") as f:
        json.dump(draws, f)


if __name__ == "__main__":
    train()   # `python unseeded_draws.py`: every worker in this process
