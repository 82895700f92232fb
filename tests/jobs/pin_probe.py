"""Reports, every step and from each logical worker's own thread, which cores that thread may run on
and how many intra-op threads torch uses: what CPU pinning (agent/cpu_pin.py) did to this agent."""

from __future__ import annotations

import json
import os

import torch
import torch.nn as nn

import elasticd

STEPS = int(os.environ.get("ELASTICD_TEST_STEPS", "8"))


@elasticd.elastic(workers=4)
def train(ctx) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    opt = torch.optim.SGD(layer.parameters(), lr=1e-2)
    layer, opt = ctx.replicate(layer, opt)
    for step in ctx.steps(STEPS):
        opt.zero_grad()
        layer(torch.ones(2, 8)).sum().backward()
        opt.step()
        line = {"step": step, "pid": os.getpid(), "cores": sorted(os.sched_getaffinity(0)),
                "threads": torch.get_num_threads()}
        with open(os.path.join(os.environ["ELASTICD_TEST_LOG"], f"rank{ctx.rank}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    train()
