"""Saving and loading worker-private objects for a resize snapshot.

`ctx.private(obj)` registrations are remembered in order; at the step boundary where the job stops,
each object's values are copied out, and when the function is re-entered on its new agent the k-th
registration loads the k-th saved state. Copies (not references) because until the run ends the
swapper may take the objects' storage away.

Copies go to host memory: a resize happens exactly when device memory is short (that is when private
state is swapped), and a device copy of every hosted rank's state at once would run out of it. Loading
(`copy_`, `load_state_dict`) moves each tensor back to its object's device.
"""

from __future__ import annotations

from typing import Any

import torch


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t` in host memory, never sharing its storage (on CPU too: the swapper may take it)."""
    return t.detach().to("cpu", copy=True)


def host_view(x: Any) -> Any:
    """Tensors of a (nested) state dict in host memory: copied from a device, as they are on CPU (no copy,
    for state nothing else will write, like the replicated state of a run that ended)."""
    if isinstance(x, torch.Tensor):
        return x.detach() if x.device.type == "cpu" else x.detach().to("cpu")
    if isinstance(x, dict):
        return {k: host_view(v) for k, v in x.items()}
    if isinstance(x, list):
        return [host_view(v) for v in x]
    if isinstance(x, tuple):
        return tuple(host_view(v) for v in x)
    return x


def save(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return host_copy(obj)
    if isinstance(obj, torch.nn.Module):
        return {k: host_copy(v) for k, v in obj.state_dict().items()}
    if isinstance(obj, torch.optim.Optimizer):
        return clone_state(obj.state_dict())
    if isinstance(obj, dict):
        return {k: save(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [save(v) for v in obj]
    raise TypeError(f"ctx.private cannot snapshot a {type(obj).__name__}")


def load(obj: Any, state: Any) -> None:
    if isinstance(obj, torch.Tensor):
        # Through .data: the object keeps its identity and autograd history is not involved.
        obj.data.copy_(state)
    elif isinstance(obj, torch.nn.Module):
        obj.load_state_dict(state)
    elif isinstance(obj, torch.optim.Optimizer):
        obj.load_state_dict(state)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            load(v, state[k])
    elif isinstance(obj, (list, tuple)):
        for v, s in zip(obj, state, strict=True):
            load(v, s)
    else:
        raise TypeError(f"ctx.private cannot restore a {type(obj).__name__}")


def clone_state(x: Any) -> Any:
    """A deep copy of a state_dict's tensors (containers rebuilt, other values shared)."""
    if isinstance(x, torch.Tensor):
        return host_copy(x)
    if isinstance(x, dict):
        return {k: clone_state(v) for k, v in x.items()}
    if isinstance(x, list):
        return [clone_state(v) for v in x]
    return x
