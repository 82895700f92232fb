"""A GPU chosen from LOCAL_RANK lands on the agent's GPU.

torchrun gives each process of a node its own GPU, and scripts pick it from LOCAL_RANK:
`torch.cuda.set_device(local_rank)` (or the device-generic `torch.accelerator.set_device_index`, which
does not go through it), `model.to(local_rank)`, `x.cuda(local_rank)`, `DDP(model, device_ids=[local_rank])`. Here the N logical workers share their agent's one GPU while LOCAL_RANK
stays what torchrun would set (0..N-1), so in worker threads of a CUDA agent those calls are pointed at
the agent's device: any CUDA index there means "my GPU". Installed only on CUDA agents (`Tensor.to` is
hot, and on a CPU agent a script has no GPU to name). Not covered: a factory call given the index
(`torch.zeros(3, device=local_rank)`) and the `torch.accelerator.device_index(k)` context, which land
on GPU `local_rank` of the node, or fail if the agent does not see it; a mixed-device op then raises, it
does not compute wrongly.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from elasticd.agent import patches
from elasticd.agent.worker import current_worker

_agent_device: torch.device | None = None
_LEDGER = patches.ledger("compat.cuda_ranks")


def mapped(arg: Any, device: torch.device) -> Any:
    """`arg` if it names no CUDA device, else `device` (an int, "cuda[:k]" or a cuda torch.device)."""
    if isinstance(arg, bool):
        return arg
    if isinstance(arg, int):
        return device
    if isinstance(arg, str) and arg.split(":")[0] == "cuda":
        return device
    if isinstance(arg, torch.device) and arg.type == "cuda":
        return device
    return arg


def _wrap(owner: Any, name: str, first_is_device: bool) -> None:
    original = getattr(owner, name)

    @functools.wraps(original)
    def patched(self: Any, *args: Any, **kwargs: Any) -> Any:
        device = _agent_device
        if device is not None and current_worker() is not None:
            if args and first_is_device:
                args = (mapped(args[0], device), *args[1:])
            if "device" in kwargs:
                kwargs["device"] = mapped(kwargs["device"], device)
        return original(self, *args, **kwargs)

    _LEDGER.set(owner, name, patched)


def install(device: torch.device) -> None:
    """Point LOCAL_RANK-chosen devices of worker threads at `device` (idempotent; the latest device wins)."""
    global _agent_device
    _agent_device = device
    if _LEDGER.active:
        return
    for owner in (torch.Tensor, torch.nn.Module):
        _wrap(owner, "to", first_is_device=True)
        _wrap(owner, "cuda", first_is_device=True)
    _wrap_setter(torch.cuda, "set_device", as_index=False)
    for name in ("set_device_index", "set_device_idx"):   # torch.accelerator's; the second is the older name
        if hasattr(torch.accelerator, name):
            _wrap_setter(torch.accelerator, name, as_index=True)


def _wrap_setter(owner: Any, name: str, as_index: bool) -> None:
    """A function that makes its argument the thread's current device: in a worker, the agent's device
    (`as_index`: given as its index, which torch.accelerator takes whatever the build's accelerator)."""
    real = getattr(owner, name)

    @functools.wraps(real)
    def set_device(device: Any) -> None:
        mine = _agent_device
        if mine is not None and current_worker() is not None:
            device = mine.index if as_index and mine.index is not None else mine
        real(device)

    _LEDGER.set(owner, name, set_device)


def uninstall() -> None:
    """Restore torch's own methods (tests; `patches.remove_all` restores them too)."""
    global _agent_device
    _LEDGER.restore()
    _agent_device = None
