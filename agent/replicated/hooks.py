"""Hooks a worker registers on replicated state run for that worker's own passes only.

Hosted workers share one model. Under DDP each process registers its hooks on a model of its own, so a
hook sees its rank's forward and backward passes and no other. Here a hook registered inside the
function, after `ctx.replicate`, on a shared module or parameter ran for every hosted worker's passes:
`p.register_hook(lambda g: g * 0.1)` (a layer's learning-rate multiplier) scaled every gradient once per
hosted worker, and a forward hook that changes an output changed it once per hosted worker too: exit 0,
1.5e-2 and 0.15 from DDP. Such a hook runs only while its own worker's pass runs: the
calling thread's worker for a forward, the baton's holder for a backward (on CUDA autograd calls backward
hooks from a device thread).

Hooks a worker registered on its own model before `ctx.replicate` (as a DDP script registers them before
wrapping) are claimed there the same way (`claim`).
"""

from __future__ import annotations

import functools
import operator
import types
from collections.abc import Callable
from typing import Any

import torch

from elasticd.agent import patches
from elasticd.agent.replicated.group import ThisModelOnly
from elasticd.agent.worker import Worker, current_worker

_MODULE_HOOKS = ("register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
                 "register_full_backward_pre_hook", "register_backward_hook")


def _owner(target: Any, is_replicated: Callable[[Any, Any], bool]) -> Worker | None:
    """The worker registering a hook on replicated `target`, or None (not a worker, or not shared)."""
    w = current_worker()
    if w is None or w.ctx is None:
        return None
    return w if is_replicated(w.runtime.replicated, target) else None


class _Owned:
    """`hook`, run only in its owner's passes: another worker's pass is as if it were another process's."""

    __slots__ = ("hook", "owner", "runtime", "claimed")

    def __init__(self, hook: Callable[..., Any], owner: Worker, claimed: bool = False) -> None:
        self.hook = hook.hook if isinstance(hook, _Owned) else hook
        self.owner = owner
        self.runtime = owner.runtime  # type: ignore[union-attr]
        self.claimed = claimed   # registered before ctx.replicate, on the first worker's own model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if (current_worker() or self.runtime.current) is not self.owner:
            return None
        return self.hook(*args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> _Owned:
        return self   # as deepcopy treats a function: a copied model (an EMA) keeps its owner's hooks

    def __reduce__(self) -> tuple[Any, ...]:
        # `torch.save(model)` pickles hook dicts: store the plain hook, loadable without elasticd.
        return operator.getitem, ([self.hook], 0)


def _owned(hook: Callable[..., Any], owner: Worker) -> Callable[..., Any]:
    return _Owned(hook, owner)


def claim(own: torch.nn.Module, shared: torch.nn.Module, owner: Worker) -> None:
    """At `ctx.replicate`: the hooks `owner` registered on its own model before (as a DDP script registers
    them before wrapping) run for its own passes only, on the shared model. The first worker's model is the
    shared one: its hooks are wrapped where they are. A later worker's model is set aside: its hooks move to
    the shared modules and parameters, where they run for that worker's passes (left on the set-aside model,
    an activation penalty they collected would be missing from its loss). Call before `share_into` replaces its parameters."""
    if isinstance(own, torch.jit.ScriptModule):
        return
    theirs = dict(shared.named_modules(remove_duplicate=False))
    counterpart = {id(m): theirs[path] for path, m in own.named_modules(remove_duplicate=False) if path in theirs}
    for path, module in own.named_modules(remove_duplicate=False):
        target = theirs.get(path)
        if target is not None:
            _claim_module(module, target, owner, counterpart)
    shared_params = dict(shared.named_parameters(remove_duplicate=False))
    for name, p in own.named_parameters(remove_duplicate=False):
        hooks = p._backward_hooks
        target = shared_params.get(name)
        if not hooks or target is None:
            continue
        if target is p:
            for key, hook in list(hooks.items()):
                hooks[key] = _Owned(hook, owner, claimed=True)
        else:
            for hook in list(hooks.values()):
                _ORIGINAL["register_hook"](target, _owned(_rebound(hook, counterpart), owner))


def _rebound(hook: Callable[..., Any], counterpart: dict[int, torch.nn.Module]) -> Callable[..., Any]:
    """A method of a module of the worker's own model, as a method of the shared model's module there.

    byol-pytorch's wrapper registers `layer.register_forward_hook(self._hook)` in its constructor, the hook
    storing the layer's output in `self.hidden`, which its forward then reads. Moved as it was, a later
    worker's hook wrote into the wrapper of the model `ctx.replicate` set aside while its forward read the
    shared wrapper's: KeyError in every later worker. The worker's model is the shared one now, so its
    hooks' methods act on that (in its own passes only, as every moved hook)."""
    owner = getattr(hook, "__self__", None)
    func = getattr(hook, "__func__", None)
    if func is None or not isinstance(owner, torch.nn.Module):
        return hook
    shared = counterpart.get(id(owner))
    return hook if shared is None else types.MethodType(func, shared)


def release(model: torch.nn.Module) -> None:
    """A later worker passed `ctx.replicate` the very model the first one did (built outside the function):
    its hooks were every worker's from the start, as they were before `claim` made them the first's."""
    dicts = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
    for module in model.modules():
        for attr in dicts:
            hooks = getattr(module, attr)
            for key, hook in list(hooks.items()):
                if isinstance(hook, _Owned) and hook.claimed:
                    hooks[key] = hook.hook
    for p in model.parameters():
        hooks = p._backward_hooks
        for key, hook in list((hooks or {}).items()):
            if isinstance(hook, _Owned) and hook.claimed:
                hooks[key] = hook.hook


def _claim_module(module: torch.nn.Module, target: torch.nn.Module, owner: Worker,
                  counterpart: dict[int, torch.nn.Module]) -> None:
    dicts = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
    if target is module:
        for attr in dicts:
            hooks = getattr(module, attr)
            for key, hook in list(hooks.items()):
                if not isinstance(hook, ThisModelOnly):   # elasticd's own, on a model replicated before
                    hooks[key] = _Owned(hook, owner, claimed=True)
        return
    for key, hook in module._forward_pre_hooks.items():
        _ORIGINAL["register_forward_pre_hook"](target, _owned(_rebound(hook, counterpart), owner),
                                               with_kwargs=key in module._forward_pre_hooks_with_kwargs)
    for key, hook in module._forward_hooks.items():
        _ORIGINAL["register_forward_hook"](target, _owned(_rebound(hook, counterpart), owner),
                                           with_kwargs=key in module._forward_hooks_with_kwargs,
                                           always_call=key in module._forward_hooks_always_called)
    for hook in module._backward_pre_hooks.values():
        _ORIGINAL["register_full_backward_pre_hook"](target, _owned(_rebound(hook, counterpart), owner))
    backward = "register_full_backward_hook" if module._is_full_backward_hook else "register_backward_hook"
    for hook in module._backward_hooks.values():
        _ORIGINAL[backward](target, _owned(_rebound(hook, counterpart), owner))


_ORIGINAL: dict[str, Callable[..., Any]] = {"register_hook": torch.Tensor.register_hook}
_ORIGINAL.update({name: getattr(torch.nn.Module, name) for name in _MODULE_HOOKS})


def _patch_tensor_hook() -> None:
    original = _ORIGINAL["register_hook"]

    @functools.wraps(original)
    def register_hook(self: torch.Tensor, hook: Callable[..., Any]) -> Any:
        owner = _owner(self, lambda state, t: state.is_replicated_param(t))
        return original(self, hook if owner is None else _owned(hook, owner))

    _LEDGER.set(torch.Tensor, "register_hook", register_hook)


def _patch_module_hook(name: str) -> None:
    original = _ORIGINAL[name]

    @functools.wraps(original)
    def register(self: torch.nn.Module, hook: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        owner = _owner(self, lambda state, m: state.is_replicated_module(m))
        return original(self, hook if owner is None else _owned(hook, owner), *args, **kwargs)

    _LEDGER.set(torch.nn.Module, name, register)


_LEDGER = patches.ledger("replicated.hooks")


def install() -> None:
    """Patch the hook registrations in this process (idempotent)."""
    if not _LEDGER.active:
        _patch_tensor_hook()
        for name in _MODULE_HOOKS:
            _patch_module_hook(name)
