"""Host synchronisations per optimizer step on a GPU: N logical workers on cuda:0 vs the plain loop.

    python scripts/gpu_syncs.py [--workers 4] [--steps 8]

torch's sync debug mode (`torch.cuda.set_sync_debug_mode("warn")`) warns at every operation that makes
the host wait for the GPU: a device-to-host copy into pageable memory, `.item()`, `.tolist()`, a
synchronising `nonzero`. This script runs scripts/_benchjob.py's MLP job three ways on cuda:0 with the
mode on and counts the warnings by the source line that raised them: (a) the plain gradient-accumulation
loop, (b) elasticd's N workers on one device in this process, (c) the same in deterministic mode. What
(b) and (c) add over (a), per step, is what the runtime makes the host wait for (the flush's used-flags,
the step-boundary vote); the design allows one small device-to-host read per flush.

Each count is per step: a run of 2S steps less a run of S, so that what a run does once (each worker moves
its model to the GPU) cancels out. With one agent there is no collective, so the flush's path for several
agents (gradient buckets) is not seen here. The last line is `runtime_syncs_per_step=X`: (b)'s count per
step less (a)'s.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4, help="N logical workers (default 4)")
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per run (default 8)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                    help="cpu only checks that the script runs: sync debug mode sees nothing there")
    a = ap.parse_args()
    os.environ.update({"ELASTICD_BENCH_WORKERS": str(a.workers), "ELASTICD_BENCH_STEPS": str(a.steps),
                       "ELASTICD_BENCH_DEVICE": a.device, "ELASTICD_BENCH_OUT": os.devnull})
    if a.device == "cuda":
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    sys.path.insert(0, str(SCRIPTS))
    import _benchjob as job
    import torch

    def counted(run: Callable[[int], object]) -> collections.Counter[str]:
        """Synchronising operations per step by source line: a run of 2S steps less one of S, so that what a
        run does once (moving the model to the GPU, the first optimizer step's allocations) cancels out."""
        run(a.steps)   # untimed: the first run in a process builds what later runs reuse
        by_run = []
        for steps in (a.steps, 2 * a.steps):
            if a.device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as seen:
                    warnings.simplefilter("always")
                    run(steps)
            finally:
                if a.device == "cuda":
                    torch.cuda.set_sync_debug_mode("default")
            by_run.append(collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in seen
                                              if "synchroniz" in str(w.message)))
        return by_run[1] - by_run[0]

    def elastic(fn: Callable[[], object]) -> Callable[[int], object]:
        def run(steps: int) -> object:
            job.STEPS = steps   # the job's loop reads it at each call
            return fn()
        return run

    runs = {"(a) plain loop": lambda steps: job.ideal_run(steps, a.workers),
            "(b) elasticd N on 1 device": elastic(job.train),
            "(c) the same, deterministic": elastic(job.train_det)}
    counts = {name: counted(run) for name, run in runs.items()}
    per_step = {name: sum(c.values()) / a.steps for name, c in counts.items()}
    print(f"N={a.workers} on {a.device}, runs of {a.steps} and {2 * a.steps} steps, counted per step as their "
          f"difference; torch {torch.__version__}" + (f", {torch.cuda.get_device_name(0)}" if a.device == "cuda" else ""))
    for name, c in counts.items():
        print(f"{name}: {per_step[name]:.2f} synchronising operations per step")
        for where, n in c.most_common(8):
            print(f"    {n / a.steps:6.2f}/step  {where}")
    plain = per_step["(a) plain loop"]
    print(f"deterministic_runtime_syncs_per_step={per_step['(c) the same, deterministic'] - plain:.2f}")
    print(f"runtime_syncs_per_step={per_step['(b) elasticd N on 1 device'] - plain:.2f}")


if __name__ == "__main__":
    main()
