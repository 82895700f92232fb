"""Optimizers, LR schedulers, GradScalers and model averages a worker made but never registered, carried
across resizes.

Users write `opt = AdamW(...)`, `sched = StepLR(opt, ...)`, `scaler = GradScaler(...)`, an EMA as
`AveragedModel(model, ...)` or `copy.deepcopy(model)`, and never pass them to `ctx.replicate` /
`ctx.private`. Under DDP nothing is lost; here the function is re-entered after a resize and would build
them again from scratch (Adam's moments gone, the LR back to its start, the EMA back to the current
weights). So their construction is hooked: made inside a worker thread, each is remembered in that
worker's creation order, its `state_dict()` goes into the worker's snapshot, and on re-entry the k-th
saved state is loaded into the k-th object the rank creates, which must be of the same type. Loading waits
for the start of `ctx.steps`: by then the function has built them all, and a scheduler's constructor (which
sets the LR) cannot undo it. An object whose state a snapshot cannot hold fails the resize with an error
naming it.

Deep copies of modules are tracked when made before `ctx.steps` began (an EMA copy, made before or after
`ctx.replicate`): the function makes them again on re-entry. A copy made inside the loop (a best-so-far
model) is not carried, as documented; nor are copies made outside a worker thread.

A copy that is part of another module is that module's state, not one of its own: `nn.TransformerEncoder`
and `nn.Transformer` deep-copy their layer in their constructors (`_get_clones`), user and library
constructors do the same (timm's `ModelEmaV2`), and builder functions pass `copy.deepcopy(attn)` into the
layers they assemble. Copies made while a module's constructor runs are never tracked, and a tracked copy
found inside a module that `ctx.replicate`, `ctx.private` or a function variable carries is carried with
it. Carried on its own, such a copy would be loaded back into the replicated model at re-entry: an in-place
change of replicated state, which the replicated-state check refuses.
"""

from __future__ import annotations

import copy
import copyreg
import functools
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from elasticd.agent import patches
from elasticd.agent.private.saving import clone_state
from elasticd.agent.worker import current_worker
from elasticd.core.errors import JobError

_LEDGER = patches.ledger("capture.carried")

if TYPE_CHECKING:
    from elasticd.agent.worker import Worker

_PLAIN = (torch.Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


class NotCarried(JobError, RuntimeError):
    """State elasticd can neither carry across a resize nor leave behind without changing the result."""


def _kinds() -> list[tuple[str, type]]:
    return [("optimizer", torch.optim.Optimizer), ("LR scheduler", torch.optim.lr_scheduler.LRScheduler),
            ("LR scheduler", torch.optim.lr_scheduler.ReduceLROnPlateau), ("GradScaler", torch.amp.GradScaler),
            ("averaged model", torch.optim.swa_utils.AveragedModel)]


def kind_of(obj: Any) -> str:
    for name, cls in _kinds():
        if isinstance(obj, cls):
            return name
    raise TypeError(f"{type(obj).__name__} is not an object elasticd carries")


def describe(obj_type: str, rank: int, index: int) -> str:
    """How errors name an object: its type, and which object the rank created it as (1-based)."""
    return (f"{obj_type} (object #{index + 1} of the optimizers/schedulers/scalers/model copies logical rank {rank} "
            f"created)")


def _hook(cls: type) -> None:
    if getattr(cls.__init__, "_elasticd_carried", False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        w = current_worker()
        # A subclass's __init__ calling its base's (StepLR -> LRScheduler) reaches here once per level:
        # only the outermost call records the object.
        outermost = w is not None and not any(o is self for o in w.capture.created[-1:])
        if outermost and w is not None:
            w.capture.created.append(self)
            w.capture.constructing += 1   # AveragedModel deep-copies its model: that copy is part of this object
        try:
            original(self, *args, **kwargs)
        finally:
            if outermost and w is not None:
                w.capture.constructing -= 1
        if outermost and w is not None and w.capture.entered_steps and w.capture.carried_restore is not None:
            # Made after the start of ctx.steps on a resumed worker: load its saved state now.
            w.capture.carried_restore.created(w, self)

    __init__._elasticd_carried = True  # type: ignore[attr-defined]
    _LEDGER.set(cls, "__init__", __init__)


def install() -> None:
    """Hook the constructors (idempotent). Objects made outside worker threads are not tracked.

    torch's SequentialLR, ChainedScheduler and ReduceLROnPlateau do not call LRScheduler.__init__, so every
    scheduler class torch defines is hooked, not only the base.
    """
    todo = [cls for _, cls in _kinds()]
    while todo:
        cls = todo.pop()
        if cls.__module__.startswith("torch.") or cls in (c for _, c in _kinds()):
            _hook(cls)
            todo.extend(cls.__subclasses__())
    _install_module_deepcopy()


class _Copy:
    """A module a worker deep-copied before its loop (see the module docstring), held weakly: tracking a copy
    the function dropped must not keep it alive. Its slot stays, so that creation order still matches."""

    __slots__ = ("ref", "type_name")

    def __init__(self, module: torch.nn.Module) -> None:
        self.ref = weakref.ref(module)
        self.type_name = f"copy of a {type(module).__qualname__}"


_copying = threading.local()   # inside a tracked module's deep copy: its submodules are part of it


def _in_module_constructor(frame: Any) -> bool:
    """Whether a frame up the stack is the `__init__` of an nn.Module: what it copies becomes part of it."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "__init__" and code.co_argcount > 0:
            if isinstance(frame.f_locals.get(code.co_varnames[0]), torch.nn.Module):
                return True
        frame = frame.f_back
    return False


def _module_deepcopy(self: torch.nn.Module, memo: dict[int, Any]) -> torch.nn.Module:
    """What `copy.deepcopy` does for a module (it defines no __deepcopy__ of its own), and remembers the
    copies a worker makes before its loop, outside any module's constructor."""
    w = current_worker()
    track = w is not None and not w.capture.entered_steps and w.capture.constructing == 0 and not getattr(_copying, "active", False)
    track = track and not _in_module_constructor(sys._getframe(1))
    if track:
        _copying.active = True
    try:
        reductor = copyreg.dispatch_table.get(type(self))
        rv = reductor(self) if reductor is not None else self.__reduce_ex__(4)
        if isinstance(rv, str):
            return self   # deepcopy's rule: a reduction to a global name is the object itself
        y = copy._reconstruct(self, memo, *rv)  # type: ignore[attr-defined]  # deepcopy's own path
    finally:
        if track:
            _copying.active = False
    if track and w is not None and (y._parameters or y._buffers or y._modules):
        w.capture.created.append(_Copy(y))
    return y


def _install_module_deepcopy() -> None:
    # Only where torch leaves Module.__deepcopy__ undefined and `copy` has the reconstruction step deepcopy
    # uses for it; a subclass with a __deepcopy__ of its own (fx's GraphModule) keeps it and is not tracked.
    if "__deepcopy__" in vars(torch.nn.Module) or not hasattr(copy, "_reconstruct"):
        return
    _LEDGER.set(torch.nn.Module, "__deepcopy__", _module_deepcopy)


@dataclass(frozen=True, slots=True)
class _Registered:
    """The slot of an object `ctx.replicate` / `ctx.private` carry themselves: its type, not the object.

    Holding the object would keep every hosted worker's set-aside optimizer alive, and with it that
    worker's own copy of the model's parameters: 8 hosted workers then took 1.44x the memory of one.
    """

    type_name: str


def _type_name(obj: Any) -> str:
    return obj.type_name if isinstance(obj, (_Registered, _Copy)) else type(obj).__qualname__


def _target(obj: Any) -> Any:
    """The object itself (None: a dropped copy)."""
    return obj.ref() if isinstance(obj, _Copy) else obj


def _carried_elsewhere(w: Worker, obj: Any) -> bool:
    # w.capture.registered: objects the replicated state keeps (and so keeps alive) and carries itself.
    return isinstance(obj, _Registered) or id(_target(obj)) in w.capture.registered


def mark_registered(w: Worker, *objs: Any) -> None:
    """`ctx.replicate` / `ctx.private` carry these themselves: keep their slot in the order, save nothing.
    So are the tracked copies inside a module among them."""
    for obj in objs:
        for k, made in enumerate(w.capture.created):
            if obj is not None and _target(made) is obj:
                w.capture.created[k] = _Registered(type(obj).__qualname__)
        if isinstance(obj, torch.nn.Module):
            absorb(w, obj)


def absorb(w: Worker, module: torch.nn.Module) -> None:
    """The tracked copies that are submodules of `module` are carried with it: keep their slots (creation
    order must still match on re-entry) under the same type name, and save nothing for them."""
    inside = {id(m) for m in module.modules() if m is not module}
    for k, made in enumerate(w.capture.created):
        if isinstance(made, _Copy) and made.ref() is not None and id(made.ref()) in inside:
            w.capture.created[k] = _Registered(made.type_name)


def save(w: Worker) -> list[dict[str, Any]]:
    """Every tracked object's type and state (None for registered ones), in creation order.

    Raises:
        NotCarried: an object's state_dict() fails or holds something a snapshot cannot (e.g. a function).
    """
    out = []
    for k, obj in enumerate(w.capture.created):
        entry: dict[str, Any] = {"type": _type_name(obj), "state": None}
        target = _target(obj)
        if target is not None and not _carried_elsewhere(w, obj):
            entry["state"] = snapshot_state(target, f"the {describe(_type_name(obj), w.rank, k)}")
        out.append(entry)
    return out


def snapshot_state(obj: Any, name: str) -> Any:
    """A copy of `obj.state_dict()` a snapshot can hold.

    Raises:
        NotCarried: state_dict() raises, or holds something a snapshot cannot (e.g. a function); `name`
            says which object in the error.
    """
    try:
        state = obj.state_dict()
    except Exception as e:  # noqa: BLE001 - named and re-raised as the reason the resize fails
        raise NotCarried(f"cannot carry {name} across the resize: its state_dict() raised "
                         f"{type(e).__name__}: {e}") from e
    bad = _first_unplain(state, "state_dict()")
    if bad is not None:
        raise NotCarried(
            f"cannot carry {name} across the resize: {bad[0]} is a {type(bad[1]).__name__}, which a "
            f"snapshot cannot hold (tensors, numbers, strings, lists and dicts only). Keep that out of "
            f"its state, or run this job without resizing it")
    return clone_state(state)


def _first_unplain(x: Any, path: str) -> tuple[str, Any] | None:
    if isinstance(x, _PLAIN) or _numpy_number(x):
        return None
    if isinstance(x, dict):
        for k, v in x.items():
            bad = _first_unplain(k, f"{path} key") or _first_unplain(v, f"{path}[{k!r}]")
            if bad is not None:
                return bad
        return None
    if isinstance(x, (list, tuple)):
        for i, v in enumerate(x):
            bad = _first_unplain(v, f"{path}[{i}]")
            if bad is not None:
                return bad
        return None
    return path, x


def _numpy_number(x: Any) -> bool:
    """A numpy number (DINO puts `lr_schedule[it]` into an optimizer's param_groups): snapshots load them
    (resize/snapshot.py `_numpy_globals`)."""
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.number | np.bool_)


class CarriedRestore:
    """A resumed worker's saved objects, loaded into the ones its re-entered function creates."""

    def __init__(self, rank: int, saved: list[dict[str, Any]]) -> None:
        self.rank = rank
        self.saved = saved
        self.loaded = 0  # saved entries matched so far (a prefix, in creation order)

    def begin_steps(self, w: Worker) -> None:
        """The start of ctx.steps: everything built before the loop gets its saved state."""
        for obj in w.capture.created[self.loaded:]:
            self.created(w, obj)

    def created(self, w: Worker, obj: Any) -> None:
        k = self.loaded
        if k >= len(self.saved):
            return  # new since the snapshot was taken: nothing to load
        entry = self.saved[k]
        if entry["type"] != _type_name(obj):
            raise NotCarried(
                f"after the resize logical rank {self.rank} created a {_type_name(obj)} where it had "
                f"created the {describe(entry['type'], self.rank, k)} before; elasticd matches them by creation "
                f"order, so the function must create the same optimizers, schedulers, scalers and model copies in the "
                f"same order every time it runs")
        self.loaded += 1
        target = _target(obj)
        if entry["state"] and target is not None and not _carried_elsewhere(w, obj):  # {}: a disabled GradScaler
            target.load_state_dict(entry["state"])

    def check_complete(self) -> None:
        """At the first step boundary after resuming: a saved state no object took would be lost silently."""
        left = [describe(e["type"], self.rank, k) for k, e in enumerate(self.saved)
                if k >= self.loaded and e["state"] is not None]
        if left:
            raise NotCarried(
                f"the {left[0]} had state before the resize, but the re-entered function did not create it again "
                f"by the first step after it ({len(left)} such object(s)). Create optimizers, schedulers, scalers and "
                f"model averages before `ctx.steps`, or pass them to ctx.private")
