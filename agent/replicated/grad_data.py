"""`.data` of a replicated gradient: an alias the ledger can see written.

`t.data` is a tensor on `t`'s memory with a version counter of its own, so an in-place write through it
(`p.grad.data.zero_()`, `p.grad.data.mul_(coef)`: the pre-1.0 idioms, DINO's per-parameter clipping)
leaves `t._version` where it was, and agent/replicated/ledger.py, which judges what a worker changed by
those counters, saw nothing. Hosted workers share one `.grad`, so each of them applied the change again,
to the others' gradients too: `p.grad.data.zero_()` before backward wiped what the earlier workers had
accumulated, exit 0. For the gradients a ledger knows, `.data` now returns `detach()`: the same memory,
the same values, the same counter, so such a write is judged like `p.grad.zero_()` and refused naming it.

Only gradients: a write through a replicated *parameter's* `.data` that every rank makes alike (WGAN's
`p.data.clamp_`, copying an EMA into the model at the end) gives DDP's result applied once per hosted
worker, and stays allowed (README, "Plain PyTorch idioms").
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

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


def _get(self: torch.Tensor) -> torch.Tensor:
    if _SHARED:
        ref = _SHARED.get(id(self))
        if ref is not None and ref() is self:
            return self.detach()
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
