"""A replicated gradient's `.data` in a worker: DINO's per-parameter clipping, once per device as once per rank.

DINO (facebookresearch/dino `utils.clip_gradients`) clips each gradient after backward with
`p.grad.data.norm(2)` and `p.grad.data.mul_(clip / norm)`. Under DDP every rank does it to its own copy of
the same average; on the one `.grad` a device's hosted workers share it would compound, and refusing it (`.data` as a
counted alias) would stop DINO at its first step.

While a gradient holds the last flush's average (the window from a flush to the next accumulation into it,
`_Entry.synced` in ledger.py), every hosted worker holds the same value, as every DDP rank does. Then:
- the device's first hosted worker (the first to run after a flush) makes an in-place update through
  `.data` on the shared gradient, uncounted, as the device's one write: what the optimizer steps with.
  Before its first write the average is kept (`pristine`);
- a later worker's `.data` is then a copy of that average of its own for the rest of its turn, so it reads
  what its DDP rank reads (DINO's norms before clipping) and its writes, dropped with the copy at its
  hand-over, change nothing shared (the first worker's identical write already did);
- otherwise a later worker's `.data` is the shared gradient, and its write, made before its own backward
  pass of the window, is dropped: its DDP rank's gradient is then the average, on which the first worker
  made the same write, or None (a first step's `p.grad.data.zero_()` loop skips it there), while the shared
  one may hold the first worker's next sums when no collective held that worker (`p.grad.data.zero_()`
  before backward, the pre-1.0 clearing, at every step). After its own backward pass (under `no_sync`) its
  share cannot be told apart from the others': refused.
The first worker's own write where the gradient holds more than the average (after its backward, under
`no_sync`) stays counted: the ledger sees it and refuses it, naming it. So a job behaves alike on every M,
also with one worker per device. Writes not through `.data` (`p.grad.mul_`) are judged as before.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from elasticd.agent.replicated.ledger import GradLedger

_BASE = torch._C.TensorBase.data   # the uncounted alias: a write through it leaves the gradient's version


def of(grad: torch.Tensor, ledger: GradLedger, i: int, rank: int) -> torch.Tensor:
    """What `grad.data` is for worker `rank`: see the module doc."""
    average = ledger.holds_average(i, grad)
    if rank == ledger.writer and not average:
        return grad.detach()   # counted: a write is judged by the ledger (refused where others accumulated)
    if rank != ledger.writer and average and ledger.entries[i].pristine is not None:
        return ledger.private_copy(i, rank)
    data = torch.Tensor._make_subclass(GradData, grad)
    data._elasticd_of = (grad, ledger, i, rank)
    return data


class GradData(torch.Tensor):
    """The shared gradient's memory: in-place updates by the device's first worker on the average are made
    uncounted (the average kept first); a later worker's are dropped as the first worker's, or refused."""

    _elasticd_of: tuple[torch.Tensor, GradLedger, int, int]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if args and type(args[0]) is GradData and _in_place(getattr(func, "__name__", "")):
            grad, ledger, i, rank = args[0]._elasticd_of
            if rank != ledger.writer:
                ledger.later_write(i, rank)   # raises after its own backward pass of the window
                return args[0]
            if ledger.holds_average(i, grad):
                e = ledger.entries[i]
                if e.pristine is None:
                    e.pristine = grad.detach().clone()
                with torch._C.DisableTorchFunctionSubclass():
                    func(_BASE.__get__(grad), *plain(args[1:], GradData), **plain(kwargs, GradData))
                return args[0]
        with torch._C.DisableTorchFunctionSubclass():
            return func(*plain(args, GradData), **plain(kwargs, GradData))

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return self.as_subclass(torch.Tensor).clone()


AUGMENTED = frozenset({"__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
                       "__ipow__", "__imatmul__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__"})


def is_update(name: str) -> bool:
    """An in-place method (`add_`) or augmented assignment (`+=`); not `__index__`, `__int__`, `__iter__`, nor
    `_foreach_mul_` (whose lists `plain` hands over as they are)."""
    return name.endswith("_") and not name.startswith("_") or name in AUGMENTED


def _in_place(name: str) -> bool:
    return is_update(name) or name == "__setitem__"


def plain(obj: Any, cls: type) -> Any:
    """`obj` with every `cls` in it (containers too) as a plain tensor on the same memory with the same version
    counter (`as_subclass`): for a gradient's, a write the subclass did not take is one the ledger sees."""
    if type(obj) is cls:
        return obj.as_subclass(torch.Tensor)
    if isinstance(obj, list | tuple):
        return type(obj)(plain(o, cls) for o in obj)
    if isinstance(obj, dict):
        return {k: plain(v, cls) for k, v in obj.items()}
    return obj
