"""The job `bench_placement.py` runs: N logical workers whose step is mostly device time.

Each logical worker-step sleeps ELASTICD_BENCH_PACE_S (default 0.02 s, in 1 ms slices) -- standing in for the kernels a
GPU would run while the host thread waits -- then takes one small MLP step on CPU. Sleeping rather than
spinning is on purpose: the benchmark runs 2 or 3 agents on a shared 2-core machine, and CPU-bound work
would make the agents slow each other down, so that the "uniform" runs would measure core contention
instead of the device speeds the benchmark imposes. Two ways to impose them (see the benchmark):
SIGSTOP/SIGCONT duty cycles of the agent from outside, or ELASTICD_BENCH_SPEEDS ("1=0.5": speed by
device index, others 1.0): the worker-step's device time is then PACE_S / speed of the device its agent
runs on (read from the agent's command line, `--device-index`; absent means 0). Knobs:
ELASTICD_BENCH_WORKERS (N, default 8), ELASTICD_BENCH_STEPS (default: until stopped), ELASTICD_BENCH_PACE_S,
ELASTICD_BENCH_SPEEDS.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import elasticd

WORKERS = int(os.environ.get("ELASTICD_BENCH_WORKERS", "8"))
STEPS = int(os.environ.get("ELASTICD_BENCH_STEPS", str(10**8)))
PACE_S = float(os.environ.get("ELASTICD_BENCH_PACE_S", "0.02"))
SLICE_S = 0.001


def _device_speed() -> float:
    """This agent's device's speed from ELASTICD_BENCH_SPEEDS (the agent process serves one device)."""
    spec = os.environ.get("ELASTICD_BENCH_SPEEDS", "")
    if not spec:
        return 1.0
    with open("/proc/self/cmdline", "rb") as f:
        argv = f.read().decode().split("\0")
    index = int(argv[argv.index("--device-index") + 1]) if "--device-index" in argv else 0
    speeds = {int(k): float(v) for k, v in (item.split("=") for item in spec.split(","))}
    return speeds.get(index, 1.0)


def _device_time(seconds: float) -> None:
    """A fixed number of 1 ms sleeps: a process stopped by SIGSTOP (how the benchmark slows a device)
    gets no further through them while stopped, so stopped a fraction f of the time it runs at about
    1 - f. One long sleep, or a wall-clock deadline, would run on through the stops, making the imposed
    slowdown far milder (or none)."""
    for _ in range(max(1, round(seconds / SLICE_S))):
        time.sleep(SLICE_S)


@elasticd.elastic(workers=WORKERS, deterministic=True)
def train(ctx) -> None:
    torch.manual_seed(0)
    device_time = PACE_S / _device_speed()
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    model, opt = ctx.replicate(model, opt)
    for _step in ctx.steps(STEPS):
        _device_time(device_time)
        x = torch.randn(8, 16)   # the worker's own RNG stream: carried across re-layouts
        loss = F.cross_entropy(model(x.to(ctx.device)), (x[:, 0] > 0).long().to(ctx.device))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.log(loss=loss.item())


if __name__ == "__main__":
    train()
