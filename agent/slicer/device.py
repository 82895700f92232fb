"""What a worker thread must do about its CUDA device: select it, and order its work after a hand-over.

Written to torch's documented semantics, and run on an H200 (tests/agent/test_cuda.py):

- The current CUDA device and the current stream are per thread. `torch.cuda.set_device` in the agent's
  main thread does not reach the worker threads, which would otherwise allocate on and launch to GPU 0:
  every thread the runtime starts that touches CUDA calls `enter_thread` first.
- Only one worker runs at a time, but the GPU runs their kernels asynchronously, on whatever stream each
  worker made current (`with torch.cuda.stream(s):`). At a hand-over the outgoing worker's thread records
  an event on its current stream, after the private-state listeners have queued their work (their swap-in
  copies are ordered before that stream: agent/private/swap_cuda.py `ready`); the incoming worker, in its
  own thread, makes its current stream wait on that event before it touches shared (replicated
  parameters, gradients) or swapped tensors. A GPU-side wait: the CPU never blocks here.
- Deterministic mode on CUDA: cuBLAS needs a fixed workspace (`CUBLAS_WORKSPACE_CONFIG`, whose size torch
  reads once, at the first cuBLAS call: set right after the script is imported, before the workers run;
  a deterministic script that runs cuBLAS at import time must export it itself), kernels must be the
  deterministic ones
  (`torch.use_deterministic_algorithms(True)`: a nondeterministic op raises instead of silently
  differing) and cuDNN must not pick algorithms by timing (`cudnn.benchmark = False`).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

import torch

CUBLAS_WORKSPACE = ":4096:8"  # one of the two settings cuBLAS documents as reproducible


def enter_thread(device: torch.device | None) -> None:
    """Make `device` this thread's current CUDA device (a no-op on CPU)."""
    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)


def record_handover(device: torch.device | None) -> Any:
    """In the outgoing thread, once the hand-over's own work is queued: an event on its current stream.

    The outgoing worker's cuBLAS workspace goes back to the caching allocator here. Every worker thread has
    a cuBLAS handle of its own and torch keeps a workspace per handle and stream (32 MiB on an H200), so N
    hosted workers held N workspaces, unaccounted by --device-memory, though one computes at a time. The
    next worker's first matmul takes a workspace of the same size again, from the allocator's cache on
    the same stream (a free is stream-ordered, so a kernel still using the block finishes first). The size
    is unchanged, so cuBLAS picks the same algorithms and deterministic results stay bitwise.
    """
    if device is None or device.type != "cuda":
        return None
    _clear_blas_workspaces()
    return torch.cuda.current_stream(device).record_event()


def _keep_blas_workspaces() -> None:
    pass


# torch's own API for it (its test harness calls it between tests); absent from builds without CUDA.
# ELASTICD_KEEP_BLAS_WORKSPACES=1 keeps every worker's, for scripts/gpu_check.sh to time the difference.
_clear_blas_workspaces = (_keep_blas_workspaces if os.environ.get("ELASTICD_KEEP_BLAS_WORKSPACES") == "1"
                          else getattr(torch._C, "_cuda_clearCublasWorkspaces", _keep_blas_workspaces))


def wait_handover(device: torch.device | None, event: Any) -> None:
    """In the incoming thread, before it runs: its current stream waits for the outgoing worker's work."""
    if event is not None and device is not None:
        torch.cuda.current_stream(device).wait_event(event)


def finish_run(device: torch.device | None) -> None:
    """After the last worker stopped, before the agent's thread reads their tensors (end listeners putting
    private state back, the resize snapshot): all their work is done, whatever streams it ran on."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def set_deterministic(device: torch.device, deterministic: bool,
                      environ: MutableMapping[str, str] | None = None) -> None:
    """Deterministic mode's per-process switches for a CUDA device (CPU: threads are pinned elsewhere).

    Only in deterministic mode. A value of CUBLAS_WORKSPACE_CONFIG the user exported is kept (workspaces of
    that size are held by the running worker's thread and the autograd engine's, not by every worker:
    `record_handover` frees the outgoing worker's).
    """
    if device.type != "cuda" or not deterministic:
        return
    env = os.environ if environ is None else environ
    env.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
