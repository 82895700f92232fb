"""Calling a decorated function directly: all N logical workers on this machine's devices."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch

from elasticd.agent import patches
from elasticd.agent.comm.physical import PhysicalGroup
from elasticd.agent.runtime import Runtime, WorkerFailed
from elasticd.agent.slicer.device import set_deterministic
from elasticd.core.layout import hosted_ranks
from elasticd.core.text import say

if TYPE_CHECKING:
    from elasticd.agent.decorator import ElasticFunction


def run_standalone(ef: ElasticFunction) -> Any:
    """Run every logical worker; returns logical rank 0's return value.

    One device (a CPU, or a single GPU) runs in this very process, which has torch as it was again when
    this returns (elasticd.agent.patches). Several GPUs get one agent process each, through the same
    node as `elasticd run`.

    Raises:
        WorkerFailed: a logical worker raised (its rank and traceback are printed to stderr first).
        SystemExit: a multi-GPU run failed (the failing rank's traceback was printed).
    """
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus > 1:
        from elasticd.local_node import run_on_node
        from elasticd.protocol import Submit

        if ef.script_path is None:
            raise RuntimeError("cannot spread an elastic function defined outside a script over several GPUs")
        devices = min(gpus, ef.workers)
        code = run_on_node(Submit(script=ef.script_path, func=ef.fn.__name__, workers=ef.workers,
                                  min_devices=devices, max_devices=devices, cwd=os.getcwd()), devices, "cuda", None)
        if code != 0:
            raise SystemExit(code)
        return None
    device = torch.device("cuda", 0) if gpus == 1 else torch.device("cpu")
    set_deterministic(device, ef.deterministic)  # CUDA: deterministic kernels, cuBLAS workspace, no cuDNN timing
    phys = PhysicalGroup(0, 1, device)
    runtime = Runtime(ef.fn, ef.workers, hosted_ranks(ef.workers, 1, 0), phys, device, ef.deterministic)
    try:
        return runtime.run().get(0)
    except WorkerFailed as f:
        # The exception raised here carries the runtime's stack; the worker's own traceback, the one the
        # user needs (as `elasticd run` prints it), is text on it: print it before it propagates.
        say(f"[elasticd] logical rank {f.rank} failed: {f.message}\n{f.traceback}")
        raise
    finally:
        patches.remove_all()  # the rest of the script sees torch as it was (agent processes keep them: they exit)
