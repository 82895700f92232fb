"""Hooks a worker registers on replicated state run for that worker's own passes only.

Hosted workers share one model. Under DDP each process registers its hooks on a model of its own, so a
hook sees its rank's forward and backward passes and no other. Here a hook registered inside the
function, after `ctx.replicate`, on a shared module or parameter ran for every hosted worker's passes:
`p.register_hook(lambda g: g * 0.1)` (a layer's learning-rate multiplier) scaled every gradient once per
hosted worker, and a forward hook that changes an output changed it once per hosted worker too: exit 0,
1.5e-2 and 0.15 from DDP (session 23). Such a hook now runs only while its own worker's pass runs: the
calling thread's worker for a forward, the baton's holder for a backward (on CUDA autograd calls backward
hooks from a device thread).

Hooks registered before `ctx.replicate` stay as they are: the first worker's model becomes the shared one,
and its hooks run for every worker's passes, which is DDP's result for a hook that keeps no per-rank
state (README, "Plain PyTorch idioms").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from elasticd.agent.worker import Worker, current_worker

_MODULE_HOOKS = ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
                 "register_full_backward_pre_hook", "register_backward_hook")


def _owner(target: Any, is_replicated: Callable[[Any, Any], bool]) -> Worker | None:
    """The worker registering a hook on replicated `target`, or None (not a worker, or not shared)."""
    w = current_worker()
    if w is None or w.ctx is None:
        return None
    return w if is_replicated(w.ctx._rt.replicated, target) else None


def _owned(hook: Callable[..., Any], owner: Worker) -> Callable[..., Any]:
    runtime = owner.ctx._rt  # type: ignore[union-attr]

    @functools.wraps(hook)
    def run(*args: Any, **kwargs: Any) -> Any:
        if (current_worker() or runtime.current) is not owner:
            return None   # another worker's pass: as if this hook were on another process's model
        return hook(*args, **kwargs)

    return run


def _patch_tensor_hook() -> None:
    original = torch.Tensor.register_hook

    @functools.wraps(original)
    def register_hook(self: torch.Tensor, hook: Callable[..., Any]) -> Any:
        owner = _owner(self, lambda state, t: state.is_replicated_param(t))
        return original(self, hook if owner is None else _owned(hook, owner))

    torch.Tensor.register_hook = register_hook  # type: ignore[method-assign]


def _patch_module_hook(name: str) -> None:
    original = getattr(torch.nn.Module, name)

    @functools.wraps(original)
    def register(self: torch.nn.Module, hook: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        owner = _owner(self, lambda state, m: state.is_replicated_module(m))
        return original(self, hook if owner is None else _owned(hook, owner), *args, **kwargs)

    setattr(torch.nn.Module, name, register)


_installed = False


def install() -> None:
    """Patch the hook registrations in this process (idempotent)."""
    global _installed
    if not _installed:
        _patch_tensor_hook()
        for name in _MODULE_HOOKS:
            _patch_module_hook(name)
        _installed = True
