"""`.data` of replicated gradients (an alias the ledger can see written) and parameters (one writer per device).

`t.data` is a tensor on `t`'s memory with a version counter of its own, so an in-place write through it
(`p.grad.data.zero_()`, `p.grad.data.mul_(coef)`: the pre-1.0 idioms, DINO's per-parameter clipping)
leaves `t._version` where it was, and agent/replicated/ledger.py, which judges what a worker changed by
those counters, saw nothing. Hosted workers share one `.grad`, so each of them applied the change again,
to the others' gradients too: `p.grad.data.zero_()` before backward wiped what the earlier workers had
accumulated, exit 0. For the gradients a ledger knows, `.data` now returns `detach()`: the same memory,
the same values, the same counter, so such a write is judged like `p.grad.zero_()` and refused naming it.

Parameters: a write through a replicated parameter's `.data` by worker code (a hand-written SGD step
`p.data.add_(p.grad, alpha=-lr)` as pytorch/examples' word_language_model makes it, a hand-made weight
decay `p.data.mul_(0.999)`, a soft target-network update) was applied once per hosted worker, exit 0;
refusing them all would also stop the writes that give DDP's result however often they are applied
(WGAN's `p.data.clamp_`, copying an EMA into the model at the end). Every rank of a DDP job makes the same
write to its own copy, so one write per device is DDP's: the device's first hosted worker gets the
parameter's memory through `.data`, as before, and the others a copy of its current values, whose writes
go nowhere (since session 23). A later worker that keeps such a copy and reads it steps later sees the
values of when it took it. The optimizer's own step (run once, agent/replicated/once.py) is the first
kind of access whatever worker runs it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from elasticd.agent.worker import current_worker

_BASE = torch._C.TensorBase.data   # the C getter and setter every tensor's `.data` goes through
# id(gradient) -> a weak reference to it, for every gradient some ledger recorded (dropped with the tensor).
_SHARED: dict[int, weakref.ref[torch.Tensor]] = {}


def share(grad: torch.Tensor) -> None:
    """`grad` is a replicated parameter's `.grad`: its `.data` becomes a counted alias."""
    key = id(grad)
    ref = _SHARED.get(key)
    if ref is not None and ref() is grad:
        return

    def forget(dead: weakref.ref[torch.Tensor], key: int = key) -> None:
        if _SHARED.get(key) is dead:
            del _SHARED[key]

    _SHARED[key] = weakref.ref(grad, forget)


# id(parameter) -> (a weak reference to it, the logical rank whose `.data` is the parameter's memory).
_PARAMS: dict[int, tuple[weakref.ref[torch.Tensor], int]] = {}


def share_param(param: torch.Tensor, writer: int) -> None:
    """`param` is replicated; `writer`, the device's first hosted rank, makes the device's one write."""
    key = id(param)

    def forget(dead: weakref.ref[torch.Tensor], key: int = key) -> None:
        entry = _PARAMS.get(key)
        if entry is not None and entry[0] is dead:
            del _PARAMS[key]

    _PARAMS[key] = (weakref.ref(param, forget), writer)


def _get(self: torch.Tensor) -> torch.Tensor:
    if _SHARED:
        ref = _SHARED.get(id(self))
        if ref is not None and ref() is self:
            return self.detach()
    if _PARAMS:
        entry = _PARAMS.get(id(self))
        if entry is not None and entry[0]() is self:
            w = current_worker()
            if w is not None and w.rank != entry[1] and w.once_running is None:
                return _BASE.__get__(self).clone()
    return _BASE.__get__(self)


def _set(self: torch.Tensor, value: Any) -> None:
    _BASE.__set__(self, value)


_installed = False


def install() -> None:
    """Route `Tensor.data` through `_get` in this process (idempotent)."""
    global _installed
    if not _installed:
        torch.Tensor.data = property(_get, _set, doc=_BASE.__doc__)  # type: ignore[assignment]
        _installed = True
