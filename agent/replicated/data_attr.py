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
write to its own copy, so one such update per device is DDP's. A worker's `.data` of
a replicated parameter is a `ParamData`: the parameter's memory, on which an in-place update that reads
what it overwrites (`add_`, `mul_`, `clamp_`, `+=`) is made by the device's first hosted worker only, and a
write that sets values whatever was there (`copy_`, `fill_`, `zero_`, item assignment) by every worker,
staying that worker's own until it sets the parameter back (replicated/swaps.py): a worker that swaps an
EMA in to evaluate and back (torch_ema's `copy_to`/`restore`) evaluates the EMA in its own forward. Not
told apart: an update written as a set, `t.data.copy_(tau * p.data + (1 - tau) * t.data)`, is made once
per hosted worker. An assignment `p.data = value` is made by the first worker only (`_set`). The
optimizer's own step (run once, agent/replicated/once.py) gets the plain memory whatever worker runs it.
"""

from __future__ import annotations

import sys
import weakref
from typing import TYPE_CHECKING, Any

import torch

from elasticd.agent import patches
from elasticd.agent.replicated import grad_data
from elasticd.agent.replicated.grad_data import is_update, plain
from elasticd.agent.worker import current_worker

if TYPE_CHECKING:
    from elasticd.agent.replicated.ledger import GradLedger

_BASE = torch._C.TensorBase.data   # the C getter and setter every tensor's `.data` goes through
# id(gradient) -> (weak references to it and to its ledger, its index there), for every gradient some ledger
# recorded (dropped with the tensor). Weak: a finished run's ledger, and its parameters, must be freed.
_SHARED: dict[int, tuple[weakref.ref[torch.Tensor], weakref.ref[GradLedger], int]] = {}


def share(grad: torch.Tensor, ledger: GradLedger, i: int) -> None:
    """`grad` is parameter i's `.grad` in `ledger`: its `.data` becomes a counted alias or grad_data's."""
    key = id(grad)
    entry = _SHARED.get(key)
    if entry is not None and entry[0]() is grad and entry[1]() is ledger and entry[2] == i:
        return

    def forget(dead: weakref.ref[torch.Tensor], key: int = key) -> None:
        found = _SHARED.get(key)
        if found is not None and found[0] is dead:
            del _SHARED[key]

    _SHARED[key] = (weakref.ref(grad, forget), weakref.ref(ledger), i)


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
        shared = _SHARED.get(id(self))
        if shared is not None and shared[0]() is self:
            w = current_worker()
            ledger = shared[1]()
            if ledger is not None and w is not None and w.ctx is not None and w.turn.once_running is None \
                    and _from_user_code():
                return grad_data.of(self, ledger, shared[2], w.rank)
            return self.detach()
    found = _worker_on(self)
    if found is not None and _from_user_code():
        w, writer = found
        data = torch.Tensor._make_subclass(ParamData, _BASE.__get__(self))
        data._elasticd_of = (self, w, w.rank != writer)
        return data
    return _BASE.__get__(self)


def _worker_on(param: torch.Tensor) -> tuple[Any, int] | None:
    """(the running worker, the device's writer rank) where `param` is replicated and worker code (not the
    optimizer's step, run once) touches it; None otherwise."""
    if not _PARAMS:
        return None
    entry = _PARAMS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    w = current_worker()
    if w is None or w.ctx is None or w.turn.once_running is not None:
        return None
    return w, entry[1]


def _from_user_code() -> bool:
    """The `.data` getter's caller is not torch itself: torch.compile's runtime reads parameters' `.data`
    in the worker's thread and must get plain tensors (a subclass failed its compiled kernels)."""
    try:
        caller = sys._getframe(2).f_globals.get("__name__", "")
    except ValueError:   # called from C with no Python caller above
        return False
    return not (caller == "torch" or caller.startswith("torch."))


# In-place methods that set values whatever the tensor held: every worker makes them, as every DDP rank does
# on its own copy (the same values: an EMA copied in at the end; or its own: an EMA swapped in to evaluate and
# swapped back, which the worker's own forward must see).
_SETS = frozenset({"copy_", "fill_", "zero_", "__setitem__", "set_", "normal_", "uniform_", "bernoulli_",
                   "random_", "exponential_", "geometric_", "log_normal_", "cauchy_"})


class ParamData(torch.Tensor):
    """A replicated parameter's `.data` in a worker: its memory. On a hosted worker other than the device's
    first, an in-place update that reads what it writes over (`add_`, `mul_`, `clamp_`, `+=`) is dropped, since
    the first worker has made it on the one shared copy, as each DDP rank makes it once on its own. A set is
    made by every worker, and is that worker's own until it sets the parameter back (replicated/swaps.py)."""

    _elasticd_of: tuple[torch.Tensor, Any, bool]   # (the parameter, the worker, whether updates are dropped)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if args and type(args[0]) is ParamData and (name in _SETS or is_update(name)):
            param, worker, later = args[0]._elasticd_of
            if name in _SETS:
                worker.runtime.replicated.swaps.before_set(worker.rank, param)
            elif later:
                return args[0]   # `p.data.add_(...)`, `p.data *= k`: made once per device, by the first worker
        with torch._C.DisableTorchFunctionSubclass():
            return func(*plain(args, ParamData), **plain(kwargs, ParamData))

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)   # saved as a plain tensor

    def __deepcopy__(self, memo: dict[int, Any]) -> torch.Tensor:
        return self.as_subclass(torch.Tensor).clone()


def _set(self: torch.Tensor, value: Any) -> None:
    """`p.data = value` on a replicated parameter, by worker code: made by the device's first hosted worker only.

    Nearly every such assignment computes the new value from the old, as MoCo's momentum encoder does
    (`param_k.data = param_k.data * m + param_q.data * (1 - m)`): made by every hosted worker, that update
    ran once per worker on the one shared copy, 1.7 from DDP, exit 0. Where the value does not depend on the
    old one (an EMA's weights put in for good) every DDP rank assigns the same values, so one assignment per
    device is DDP's too; one swapped in around an evaluation and back is in place for the later workers'
    evaluations as well, since they run between the first worker's two assignments."""
    found = _worker_on(self)
    if found is not None and found[0].rank != found[1] and _from_user_code():
        return
    _BASE.__set__(self, plain(value, ParamData))


_LEDGER = patches.ledger("replicated.data_attr")


def install() -> None:
    """Route `Tensor.data` through `_get` in this process (idempotent)."""
    if not _LEDGER.active:
        _LEDGER.set(torch.Tensor, "data", property(_get, _set, doc=_BASE.__doc__))
