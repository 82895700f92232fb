"""Saving and loading worker-private objects for a resize snapshot.

`ctx.private(obj)` registrations are remembered in order; at the step boundary where the job stops,
each object's values are copied out, and when the function is re-entered on its new agent the k-th
registration loads the k-th saved state. Copies (not references) because until the run ends the
swapper may take the objects' storage away.
"""

from __future__ import annotations

from typing import Any

import torch


def save(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, torch.nn.Module):
        return {k: v.detach().clone() for k, v in obj.state_dict().items()}
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
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: clone_state(v) for k, v in x.items()}
    if isinstance(x, list):
        return [clone_state(v) for v in x]
    return x
