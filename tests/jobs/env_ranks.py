"""An @elastic function ported from a torchrun script: it reads its rank from torchrun's environment and
starts and destroys its process group itself. Each rank writes what it saw to $ELASTICD_TEST_OUT/rank<r>.json,
under elasticd and under the real-DDP reference alike (tests/agent/compat/test_torch_dist.py), with the module name pickle
records for a class of the script (a checkpoint's config): in both, what `import env_ranks` finds again."""

from __future__ import annotations

import json
import os
import pickle
from dataclasses import dataclass

import torch
from torch.distributed import all_reduce, destroy_process_group, get_rank, init_process_group

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))


@dataclass
class RunConfig:
    width: int = 8


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    init_process_group(backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    total = torch.tensor([float(rank)])
    all_reduce(total)
    seen = {"rank": rank, "world": world, "local_rank": int(os.environ["LOCAL_RANK"]), "get_rank": get_rank(),
            "ctx_rank": ctx.rank, "sum_of_ranks": total.item(),
            "pickled_as": type(pickle.loads(pickle.dumps(RunConfig()))).__module__}
    destroy_process_group()
    with open(os.path.join(os.environ["ELASTICD_TEST_OUT"], f"rank{ctx.rank}.json"), "w") as f:
        json.dump(seen, f)


if __name__ == "__main__":
    train()
