"""Lists, tuples and dicts of tensors the function keeps in its own variables, carried across resizes.

An EMA kept by hand (`ema = {k: v.detach().clone() for k, v in model.state_dict().items()}`, updated in
place every step), a history of loss tensors (`losses.append(loss.detach())`), per-class running sums: a
DDP process keeps them for life, while a resumed function builds them again from scratch and would end
with another result, exit 0. function_locals.py carries plain values and tensors held by a variable
itself; this carries containers (exactly lists, tuples and dicts, nested) of plain values and arrays
(local_arrays.is_array, and tensors autograd records as leaves that are no model's), held by the same
variables and attributes:

- where `ctx.steps` begins, each is noted: its structure, plain values, array shapes and dtypes, and which
  array objects it holds at which count of in-place writes (weakly);
- a snapshot copies, whole and to the host, each one the loop changed since (an item added, removed or
  replaced, an array written in place), with each array's device type;
- a resumed worker gets it back where the re-entered function built it with the same structure, plain
  values and array shapes and dtypes as the first run did; its arrays' values may differ (an EMA copied
  from the model the resize restored). A list or dict is refilled in place; arrays are new ones on their
  device, never written into (one may be a view of a dataset).

Not a container holding a tensor of a model or optimizer the function's variables hold (`[p.data for p in
model.parameters()]`, `{n: p.grad ...}`) or of the worker's `ctx.private` state: it is a view of state
carried its own way, which the re-entered function takes again, and a copy in its place would no longer
follow the model (or be what the private store swaps).

A changed container holding more than 1 GiB of arrays is not copied: the snapshot fails naming it, which
refuses a resize (agent/slicer/boundary.py) instead of resuming without it.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from elasticd.agent.capture.carried import NotCarried
from elasticd.agent.capture.local_arrays import from_snapshot, is_array, nbytes, to_snapshot, writes
from elasticd.agent.private.swap import tensors_of
from elasticd.agent.worker import current_worker

_MAX_ITEMS = 100_000      # as function_locals: a bigger container is not looked into
_MAX_BYTES = 1 << 30      # the arrays of one container a snapshot copies
_ARRAY = "__elasticd_array__"   # marks an array in a packed container (no user dict has this key)
# A state_dict() is an OrderedDict: `best = copy.deepcopy(model.state_dict())` is a container like any dict.
_DICTS = (dict, collections.OrderedDict)


def _walk(x: Any, arrays: list[Any], budget: list[int]) -> Any:
    """`x`'s shape: its structure with plain values as they are and arrays as (shape, dtype), collecting the
    arrays in order; None when `x` holds anything else (or more than the budget of items)."""
    budget[0] -= 1
    if budget[0] < 0:
        return None
    if x is None or isinstance(x, (bool, int, float, str)):
        return ("=", x)
    if is_array(x) or _free_leaf(x):
        arrays.append(x)
        return ("array", tuple(x.shape), str(x.dtype), _grad_kind(x))
    if type(x) in (list, tuple) or type(x) in _DICTS:
        items = x.items() if type(x) in _DICTS else enumerate(x)
        inner = []
        for k, v in items:
            shape = _walk(v, arrays, budget) if isinstance(k, (str, int)) else None
            if shape is None:
                return None
            inner.append((k, shape))
        return (type(x).__name__, tuple(inner))
    return None


def _free_leaf(x: Any) -> bool:
    """A tensor autograd records as a leaf that is no model's (those are excluded as views, below): an EMA
    kept as copies of the parameters (`copy.deepcopy(list(model.parameters()))`, as improved-diffusion's
    `ema_params`)."""
    return isinstance(x, torch.Tensor) and x.requires_grad and x.is_leaf and x.layout == torch.strided


def _grad_kind(x: Any) -> str:
    if not isinstance(x, torch.Tensor) or not x.requires_grad:
        return ""
    return "parameter" if isinstance(x, torch.nn.Parameter) else "leaf"


def _shape(x: Any) -> tuple[Any, list[Any]] | None:
    if type(x) not in (list, tuple, *_DICTS):
        return None
    arrays: list[Any] = []
    shape = _walk(x, arrays, [_MAX_ITEMS])
    return (shape, arrays) if shape is not None else None


def is_container(x: Any) -> bool:
    """`x` is a container this module carries whole: lists, tuples and dicts of plain values and arrays."""
    return _shape(x) is not None


def _frozen(x: Any) -> Any:
    """A shape as noted, whatever a snapshot's round trip made of its tuples."""
    return tuple(_frozen(v) for v in x) if isinstance(x, (list, tuple)) else x


class NotedContainer:
    """A container as the loop began: its shape, its arrays by identity and count of in-place writes, and
    whether it was taken from a model (`taken`: see ModelState.taken_from)."""

    def __init__(self, shape: Any, arrays: list[Any], taken: bool = False) -> None:
        self.shape = shape
        self.arrays = [(weakref.ref(a), writes(a)) for a in arrays]
        self.taken = taken

    def changed(self, shape: Any, arrays: list[Any]) -> bool:
        """The loop changed it, and it holds arrays now or did then (a container of plain values only, both
        times, is function_locals' to carry); or it was taken from a model, which is carried unchanged too."""
        if not arrays and not self.arrays:
            return False
        if self.taken:
            return True
        return shape != self.shape or any(ref() is not a or writes(a) != n
                                          for (ref, n), a in zip(self.arrays, arrays, strict=True))


def storage(t: torch.Tensor) -> int:
    """Where `t`'s memory lives (its storage's address), the same for every view of it; 0 for none."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):   # a tensor without storage of its own (a functional wrapper)
        return 0


def _models_tensors(named: list[tuple[str, Any]]) -> Iterator[torch.Tensor]:
    """The tensors of the models and optimizers the function's variables hold: parameters (a module's or an
    optimizer's), buffers, gradients, optimizer states."""
    for _key, value in named:
        if isinstance(value, torch.nn.Module):
            for t in itertools.chain(value.parameters(), value.buffers()):
                yield t
                if t.grad is not None:
                    yield t.grad
        elif isinstance(value, torch.optim.Optimizer):
            yield from (x for state in value.state.values() for x in state.values() if isinstance(x, torch.Tensor))
            yield from (p for group in value.param_groups for p in group["params"])


def models_storages(named: list[tuple[str, Any]]) -> set[int]:
    """Where the tensors of the models and optimizers the function's variables hold live, and the worker's
    private state (`private_storages`)."""
    found = {storage(t) for t in _models_tensors(named)} | private_storages()
    found.discard(0)
    return found


def private_storages() -> set[int]:
    """Where the running worker's `ctx.private` state lives. The private store carries it and swaps it under
    a device budget, so a variable or container holding it must keep the registered tensors: a copy given
    back at re-entry would hold the state twice on the device, beside tensors the store swaps that the
    function no longer uses."""
    w = current_worker()
    found = {storage(t) for obj in w.progress.private for t in tensors_of(obj)} if w is not None else set()
    found.discard(0)
    return found


class ModelState:
    """The models' and optimizers' tensors where the loop begins: where they live (views of them are the new
    run's, never given back), and their values, to tell what the function took from them."""

    def __init__(self, named: list[tuple[str, Any]]) -> None:
        self.storages: set[int] = set()
        self._by_kind: dict[tuple[Any, ...], list[torch.Tensor]] = collections.defaultdict(list)
        for t in _models_tensors(named):
            self.storages.add(storage(t))
            self._by_kind[(tuple(t.shape), t.dtype, t.device)].append(t)
        self.storages |= private_storages()   # carried by the private store, as the models are by theirs
        self.storages.discard(0)

    def taken_from(self, arrays: list[Any]) -> bool:
        """Some tensor of `arrays` (no view of a model's state) holds the values of a model's or optimizer's
        tensor: a copy taken before the loop (an L2-SP anchor `[p.detach().clone() for p in
        model.parameters()]`, the best weights so far `copy.deepcopy(model.state_dict())`). Under DDP it
        keeps the values the job began with; a resumed function would take it again from the model the
        resize restored, so it is carried whether or not the loop changes it. A tensor equal to a model's
        by chance (zeros like a bias) is carried for nothing, at no cost to the result."""
        for a in arrays:
            if not isinstance(a, torch.Tensor) or storage(a) in self.storages or a.layout != torch.strided:
                continue
            for t in self._by_kind.get((tuple(a.shape), a.dtype, a.device), ()):
                try:
                    if torch.equal(a.detach(), t.detach()):
                        return True
                except (RuntimeError, NotImplementedError):   # no values to compare (meta), or another layout
                    continue
        return False


def views_of(arrays: list[Any], storages: set[int]) -> bool:
    return any(isinstance(a, torch.Tensor) and storage(a) in storages for a in arrays)


def note(named: list[tuple[str, Any]], models: ModelState) -> dict[str, NotedContainer]:
    """key -> each container of plain values and arrays the function's variables (`named`:
    function_locals._named) hold, but views of its models' state; an empty list counts (a loss history
    begins so)."""
    found = {}
    for key, value in named:
        seen = _shape(value)
        if seen is not None and not views_of(seen[1], models.storages):
            found[key] = NotedContainer(*seen, taken=models.taken_from(seen[1]))
    return found


def save(named: list[tuple[str, Any]], start: dict[str, NotedContainer], where: Any) -> dict[str, Any]:
    """key -> {"start": its shape as the loop began, "value": a host copy} for each container the loop changed.

    Raises:
        NotCarried: a changed container holds more than 1 GiB of arrays (`where(key)` names it).
    """
    out, copied = {}, set()
    storages = models_storages(named) if start else set()
    for key, value in named:
        noted = start.get(key)
        seen = _shape(value) if noted is not None and id(value) not in copied else None
        if noted is None or seen is None or not noted.changed(*seen) or views_of(seen[1], storages):
            continue
        copied.add(id(value))   # once: another name for it (`self.ema` and `ema`) is refilled with it
        size = sum(nbytes(a) for a in seen[1])
        if size > _MAX_BYTES:
            what = ("it holds copies of a model's tensors taken before the loop, which the resumed function would "
                    "take again from the model the resize restored" if noted.taken else
                    "the loop changed this container since ctx.steps began")
            raise NotCarried(f"cannot carry {where(key)} across the resize: {what}; its {size / 2**20:.0f} MiB of "
                             f"tensors are over the {_MAX_BYTES >> 20} MiB a snapshot copies of a container. Keep "
                             "a model average or a copy of the weights as a model (copy.deepcopy, torch's "
                             "AveragedModel), which elasticd carries")
        out[key] = {"start": noted.shape, "value": _pack(value)}
    return out


def restored(saved: dict[str, Any], start: dict[str, NotedContainer]) -> dict[str, Any]:
    """key -> the value to give back, for each saved container the re-entered function began as the first
    run did."""
    return {key: _unpack(entry["value"]) for key, entry in saved.items()
            if key in start and start[key].shape == _frozen(entry["start"])}


def _pack(x: Any) -> Any:
    if is_array(x) or _free_leaf(x):
        return {_ARRAY: to_snapshot(x), "device": x.device.type if isinstance(x, torch.Tensor) else "",
                "grad": _grad_kind(x)}
    if type(x) in _DICTS:
        return type(x)((k, _pack(v)) for k, v in x.items())
    if type(x) in (list, tuple):
        return type(x)(_pack(v) for v in x)
    return x


def _device(kind: str) -> torch.device | None:
    if not kind:
        return None   # numpy
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())   # the worker thread's GPU (slicer/device.py)
    return torch.device(kind)


def _unpack(x: Any) -> Any:
    if type(x) is dict and _ARRAY in x:
        a = from_snapshot(x[_ARRAY], _device(x["device"]))
        if x.get("grad") == "parameter":
            return torch.nn.Parameter(a)
        return a.requires_grad_(True) if x.get("grad") == "leaf" else a
    if type(x) in _DICTS:
        return type(x)((k, _unpack(v)) for k, v in x.items())
    if type(x) in (list, tuple):
        return type(x)(_unpack(v) for v in x)
    return x
