"""torch's own once-per-step idioms on replicated state, made to run once per physical step.

After the gradient flush the baton restarts at the first hosted worker, which runs its post-backward code
and then its next step's forward and backward before the second worker runs its post-backward code. So
whatever a worker does to shared state after backward must run once, by the first worker, or it acts on
the next step's partial gradients (clipping, unscaling) or moves the shared learning rate once per hosted
worker (schedulers). What is patched here, in the whole process but acting only in worker threads and only
on replicated state (everything else gets torch's own behaviour):

- `torch.nn.utils.clip_grad_norm_` / `clip_grad_value_` (and `clip_grad_norm`), as module attributes
  (`torch.nn.utils.X`, `torch.nn.utils.clip_grad.X`) and as names the elastic function's module imported
  (`from torch.nn.utils import clip_grad_norm_`, rebound by `install(fn)` like compat/torch_dist.py does);
  likewise the two halves `torch.nn.utils.get_total_norm` (over replicated `.grad`s) and
  `clip_grads_with_norm_`;
- `torch.amp.GradScaler.unscale_` (also reached from `scaler.step`): the first worker unscales the shared
  gradient, the others' scalers record its inf/nan findings, so every scaler's `update` agrees; and
  `GradScaler.__init__`, so a scaler's scale and growth tracker survive a resize;
- the constructors of LR schedulers (`LRScheduler.__init__`, which every torch scheduler but the ones
  below reaches through `super()`, and `ReduceLROnPlateau`, `SequentialLR`, `ChainedScheduler`): one built
  over a replicated optimizer gets a subclass of its own class whose `step` runs once per physical step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as clip_grad
from torch.amp.grad_scaler import GradScaler
from torch.optim import lr_scheduler

from elasticd.agent import patches
from elasticd.agent.replicated import data_attr, hooks, write_once
from elasticd.agent.replicated.views import ReplicatedOptimizer
from elasticd.agent.worker import Worker, current_worker

if TYPE_CHECKING:
    from elasticd.agent.replicated.state import ReplicatedState

ORIGINAL_CLIPS = {name: getattr(clip_grad, name) for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grad_norm")}
# Public only in torch.nn.utils: torch's own clip_grad_norm_ calls clip_grad's private names, which stay.
UTILS_ORIGINALS = {"get_total_norm": torch.nn.utils.get_total_norm,
                   "clip_grads_with_norm_": torch.nn.utils.clip_grads_with_norm_}
_PATCHES: dict[str, Callable[..., Any]] = {}       # clip_grad.<name> and torch.nn.utils.<name>
_UTILS_PATCHES: dict[str, Callable[..., Any]] = {}  # torch.nn.utils.<name> only


def _state(w: Worker | None) -> ReplicatedState | None:
    if w is None or w.ctx is None:
        return None
    return w.runtime.replicated


def _params(parameters: Any) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _replicated_params(st: ReplicatedState, params: list[torch.Tensor], fn: str) -> bool:
    """True if `params` are replicated parameters; a mix with private ones cannot be clipped as DDP does."""
    n = st.replicated_share(params)
    if 0 < n < len(params):
        raise NotImplementedError(
            f"elasticd: {fn} over a mix of ctx.replicate'd and other parameters is not supported: the "
            f"replicated gradients are shared by every hosted worker, the others are not; clip them in "
            f"separate calls")
    return n > 0


def _clip_norm(name: str) -> Callable[..., Any]:
    original = ORIGINAL_CLIPS[name]

    @functools.wraps(original)
    def patched(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        w = current_worker()
        st = _state(w)
        params = _params(parameters)
        if st is None or w is None or not _replicated_params(st, params, f"torch.nn.utils.{name}"):
            return original(params, *args, **kwargs)
        # The first hosted worker clips the averaged gradient; every worker gets the same total norm.
        return st.clip_norm_once.call(w.rank, lambda: original(params, *args, **kwargs)).clone()

    return patched


def _in_place_once(original: Callable[..., Any], name: str) -> Callable[..., None]:
    """A clipping function that writes the gradients and returns nothing: run once per step."""

    def patched(parameters: Any, *args: Any, **kwargs: Any) -> None:
        w = current_worker()
        st = _state(w)
        params = _params(parameters)
        if st is None or w is None or not _replicated_params(st, params, f"torch.nn.utils.{name}"):
            return original(params, *args, **kwargs)
        st.clip_in_place_once.call(w.rank, lambda: original(params, *args, **kwargs))
        return None

    return patched


def _total_norm(tensors: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
    """`get_total_norm([p.grad ...])` over replicated gradients: computed once, on the averaged gradient."""
    original = UTILS_ORIGINALS["get_total_norm"]
    w = current_worker()
    st = _state(w)
    given = _params(tensors)
    if st is None or w is None:
        return original(given, *args, **kwargs)
    n = st.replicated_grad_share(given)
    if n == 0:
        return original(given, *args, **kwargs)
    if n < len(given):
        raise NotImplementedError(
            "elasticd: torch.nn.utils.get_total_norm over a mix of replicated gradients and other tensors "
            "is not supported: the replicated gradients are shared by every hosted worker; compute them "
            "in separate calls")
    return st.clip_norm_once.call(w.rank, lambda: original(given, *args, **kwargs)).clone()


_PATCHES["clip_grad_norm_"] = _clip_norm("clip_grad_norm_")
_PATCHES["clip_grad_norm"] = _clip_norm("clip_grad_norm")
_PATCHES["clip_grad_value_"] = functools.wraps(ORIGINAL_CLIPS["clip_grad_value_"])(
    _in_place_once(ORIGINAL_CLIPS["clip_grad_value_"], "clip_grad_value_"))
_UTILS_PATCHES["get_total_norm"] = functools.wraps(UTILS_ORIGINALS["get_total_norm"])(_total_norm)
_UTILS_PATCHES["clip_grads_with_norm_"] = functools.wraps(UTILS_ORIGINALS["clip_grads_with_norm_"])(
    _in_place_once(UTILS_ORIGINALS["clip_grads_with_norm_"], "clip_grads_with_norm_"))


# -- GradScaler -----------------------------------------------------------------------------------

_SCALER_INIT = GradScaler.__init__
_SCALER_UNSCALE = GradScaler.unscale_


@functools.wraps(_SCALER_INIT)
def _scaler_init(self: GradScaler, *args: Any, **kwargs: Any) -> None:
    _SCALER_INIT(self, *args, **kwargs)
    w = current_worker()
    st = _state(w)
    if st is not None and w is not None:
        st.built_scaler(w, self)


@functools.wraps(_SCALER_UNSCALE)
def _unscale_(self: GradScaler, optimizer: torch.optim.Optimizer) -> None:
    w = current_worker()
    st = _state(w)
    if st is None or w is None or not isinstance(optimizer, ReplicatedOptimizer) or not self._enabled:
        return _SCALER_UNSCALE(self, optimizer)
    st.unscale_(w, self, optimizer, lambda: _SCALER_UNSCALE(self, optimizer))
    return None


# -- LR schedulers ----------------------------------------------------------------------------------

_ONCE_CLASSES: dict[type, type] = {}


def _once_class(cls: type) -> type:
    """`cls` with a `step` that runs once per physical step (same name, so reprs and errors read the same)."""
    if getattr(cls, "__elasticd_once__", False):
        return cls
    sub = _ONCE_CLASSES.get(cls)
    if sub is None:
        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            w = current_worker()
            st = _state(w)
            if st is None or w is None:
                return cls.step(self, *args, **kwargs)
            return st.step_scheduler(w, self, args, kwargs, lambda: cls.step(self, *args, **kwargs))

        sub = type(cls.__name__, (cls,), {"step": step, "__elasticd_once__": True,
                                          "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                                          "__doc__": cls.__doc__})
        _ONCE_CLASSES[cls] = sub
    return sub


def _patch_constructor(cls: type, find_optimizer: Callable[..., Any]) -> Callable[..., None]:
    original = cls.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        w = current_worker()
        st = _state(w)
        opt = find_optimizer(*args, **kwargs)
        if st is None or w is None or not isinstance(opt, ReplicatedOptimizer) or st.building_scheduler:
            original(self, *args, **kwargs)
            return
        st.build_scheduler(w, self, opt, lambda: original(self, *args, **kwargs))
        self.__class__ = _once_class(type(self))

    return init


def _first_arg_optimizer(optimizer: Any = None, *args: Any, **kwargs: Any) -> Any:
    return kwargs.get("optimizer", optimizer)


def _chained_optimizer(schedulers: Any = None, optimizer: Any = None, *args: Any, **kwargs: Any) -> Any:
    schedulers = kwargs.get("schedulers", schedulers)
    optimizer = kwargs.get("optimizer", optimizer)
    if optimizer is None and schedulers:
        optimizer = getattr(list(schedulers)[0], "optimizer", None)
    return optimizer


_SCHEDULER_CONSTRUCTORS: list[tuple[type, Callable[..., Any]]] = [
    (lr_scheduler.LRScheduler, _first_arg_optimizer),
    (lr_scheduler.ReduceLROnPlateau, _first_arg_optimizer),
    (lr_scheduler.SequentialLR, _first_arg_optimizer),
    (lr_scheduler.ChainedScheduler, _chained_optimizer),
]


# -- installing -----------------------------------------------------------------------------------

_LEDGER = patches.ledger("replicated.idioms")


def install(fn: Callable[..., Any] | None = None) -> None:
    """Patch torch's idioms in this process (idempotent); rebind names imported into `fn`'s module."""
    if not _LEDGER.active:
        for name, patched in _PATCHES.items():
            _LEDGER.set(clip_grad, name, patched)
            _LEDGER.set(torch.nn.utils, name, patched)
        for name, patched in _UTILS_PATCHES.items():
            _LEDGER.set(torch.nn.utils, name, patched)
        data_attr.install()   # `.data` of replicated gradients and parameters (agent/replicated/data_attr.py)
        hooks.install()       # hooks registered on replicated state run for their worker's passes only
        write_once.install()  # `model.tau *= k` on a replicated model made once per device
        _LEDGER.set(GradScaler, "__init__", _scaler_init)
        _LEDGER.set(GradScaler, "unscale_", _unscale_)
        for cls, find in _SCHEDULER_CONSTRUCTORS:
            _LEDGER.set(cls, "__init__", _patch_constructor(cls, find))
    namespace = getattr(fn, "__globals__", None)
    if namespace is not None:
        replacements = {id(ORIGINAL_CLIPS[name]): patched for name, patched in _PATCHES.items()}
        replacements.update({id(UTILS_ORIGINALS[name]): patched for name, patched in _UTILS_PATCHES.items()})
        for key, value in list(namespace.items()):
            new = replacements.get(id(value))
            if new is not None:
                _LEDGER.set_item(namespace, key, new)
