"""The agent's replicated state: the `ctx.replicate` groups and every once-per-step idiom over them.

The runtime holds one `ReplicatedState`. It builds the shared groups (`ctx.replicate`), clips their
gradients (`ctx.clip_grad_norm_`, and torch's clipping functions by any name, see idioms.py), and keeps
the objects each worker builds over a replicated optimizer after `ctx.replicate` — LR schedulers and
`GradScaler`s — in step: hosted workers run the same program, so the k-th such object of every hosted
worker is one logical object, and the k-th call of a method that touches shared state is one logical
call (`OncePerStep`). Their state is also what a resize must carry: it goes into each worker's snapshot
extras and is loaded into the k-th object the worker builds after resuming.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.amp.grad_scaler import OptState

from elasticd.agent.replicated import data_attr, hooks
from elasticd.agent.replicated.group import ReplicatedGroup
from elasticd.agent.replicated.idioms import ORIGINAL_CLIPS
from elasticd.agent.replicated.once import OncePerStep
from elasticd.agent.replicated.share import share_into
from elasticd.agent.replicated.swaps import ParamSwaps
from elasticd.agent.replicated.write_once import WriteCounts, shared_groups

if TYPE_CHECKING:
    from elasticd.agent.resize.snapshot import GroupSnapshot
    from elasticd.agent.runtime import Runtime
    from elasticd.agent.worker import Worker

SCHEDULERS = "replicated_schedulers"  # snapshot extras: state_dicts of schedulers built after replicate
SCALERS = "grad_scalers"              # snapshot extras: state_dicts of GradScalers built in the worker


@dataclass
class _Built:
    """What every hosted worker's k-th scheduler shares: its step, run once, and the leader's state."""

    step_once: OncePerStep
    state: dict[str, Any]


@dataclass
class _PerWorker:
    schedulers: list[Any] = field(default_factory=list)  # built over a replicated optimizer, in order
    scalers: list[Any] = field(default_factory=list)     # GradScalers built in this worker, in order


def _hyperparameters(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


class ReplicatedState:
    def __init__(self, runtime: Runtime, restore: list[GroupSnapshot]) -> None:
        self.runtime = runtime
        self.groups: list[ReplicatedGroup] = []
        self._restore = restore
        ranks = runtime.hosted
        self.clip_norm_once = OncePerStep(ranks, "clip_grad_norm_ on replicated gradients")
        self.clip_in_place_once = OncePerStep(ranks, "clipping replicated gradients")  # clip_grad_value_, clip_grads_with_norm_: return None
        self.unscale_once = OncePerStep(ranks, "GradScaler.unscale_ of the replicated optimizer")
        self._sched_build_once = OncePerStep(ranks, "a scheduler's constructor over the replicated optimizer")
        self._built: list[_Built] = []
        self._sched_index: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._workers = {r: _PerWorker() for r in ranks}
        self.swaps = ParamSwaps()   # values set through a parameter's .data: each worker's own (swaps.py)
        self.attr_writes = WriteCounts()   # plain attributes worker code sets on replicated modules (write_once.py)
        self._params: dict[int, ReplicatedGroup] = {}
        self._frozen: set[int] = set()   # parameters of a replicated model that need no gradient
        self._building = False  # inside a scheduler's constructor: nested constructors are part of it
        self._stepping = False  # inside a scheduler's step run once: nested steps are part of it

    # -- ctx.replicate ------------------------------------------------------------------------
    def replicate(self, w: Worker, model: torch.nn.Module, optimizer: Any, scheduler: Any) -> Any:
        index = w.turn.replicate_calls
        w.turn.replicate_calls += 1
        if index == len(self.groups):
            # The first hosted worker to get here builds the shared copy (on agent 0 that is rank 0),
            # and every agent adopts agent 0's state, as DDP's constructor does.
            hooks.claim(model, model, w)
            group = ReplicatedGroup(index, self.runtime, model, optimizer, scheduler)
            group.builder = w.rank
            if index < len(self._restore):
                # Every agent holds the same snapshot of replicated state: load it, no broadcast needed.
                group.load(self._restore[index])
            else:
                group.broadcast_state()
            if group.optimizer is not None:
                shared_groups(group.optimizer)   # hyperparameter writes made once (write_once.py)
            writer = min(self.runtime.hosted)
            for p in model.parameters():
                data_attr.share_param(p, writer)
            self.groups.append(group)
            self._params.update({id(p): group for p in group.params})
            self._frozen.update(id(p) for p in model.parameters() if id(p) not in self._params)
        group = self.groups[index]
        if model is group.model and w.rank != group.builder:
            hooks.release(model)   # one model for all, built outside the function: its hooks are all's
        if model is not group.model:
            hooks.claim(model, group.model, w)
            share_into(model, group.model, w.rank)
            group.adopt_modes(w.rank, model)
        if optimizer is not None and group.optimizer is not None and optimizer is not group.optimizer:
            # This worker's own optimizer is set aside, but schedulers it built over it before this call
            # keep stepping it and report its learning rate: after a resize it is new and at its initial
            # rates, so give it the shared (restored) ones, as a DDP rank's own optimizer would have.
            # Its parameter lists point at the shared parameters too, so that a scheduler holding it does not
            # keep this worker's own copy of the model alive (one copy per device, however many workers).
            for mine, shared in zip(optimizer.param_groups, group.optimizer.param_groups, strict=False):
                mine.update({k: v for k, v in shared.items() if k != "params"})
                mine["params"] = list(shared["params"])
            optimizer.state.clear()
        if optimizer is None:
            return group.model
        if scheduler is None:
            return group.model, group.opt_view
        return group.model, group.opt_view, group.sched_view

    def replicated_share(self, params: list[torch.Tensor]) -> int:
        """How many of `params` are parameters of a replicated model (callers reject a mix with private ones).

        A frozen one counts: `clip_grad_norm_(model.parameters())` over a model with a frozen part is one
        call over replicated state, and clipping skips a parameter that has no gradient."""
        return sum(id(p) in self._params or id(p) in self._frozen for p in params)

    def is_replicated_param(self, t: torch.Tensor) -> bool:
        return id(t) in self._params

    def is_replicated_module(self, m: torch.nn.Module) -> bool:
        return any(g.holds_module(m) for g in self.groups)

    def replicated_grad_share(self, tensors: list[torch.Tensor]) -> int:
        """How many of `tensors` are the current `.grad` of a replicated parameter."""
        grads = {id(p.grad) for g in self.groups for p in g.params if p.grad is not None}
        return sum(id(t) in grads for t in tensors)

    # -- clipping -----------------------------------------------------------------------------
    def clip_grad_norm_(self, w: Worker, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """`ctx.clip_grad_norm_`: every replicated parameter, on the averaged gradient, once per step.

        Run by the first hosted worker right after the flush, before it starts the next step's backward:
        a later worker clipping the shared `.grad` would clip the next step's partial sum. Every worker
        gets the same total norm (its own tensor, as each DDP rank has).
        """
        if not self.groups:
            raise RuntimeError("ctx.clip_grad_norm_ needs a model passed to ctx.replicate first")
        params = [p for g in self.groups for p in g.params]
        clip = ORIGINAL_CLIPS["clip_grad_norm_"]
        return self.clip_norm_once.call(w.rank, lambda: clip(params, max_norm, norm_type=norm_type)).clone()

    # -- LR schedulers built over a replicated optimizer after ctx.replicate ---------------------
    def build_scheduler(self, w: Worker, sched: Any, opt: torch.optim.Optimizer, init: Callable[[], None]) -> None:
        """Construct `sched` (run `init`) as the worker's next scheduler over a replicated optimizer.

        The first hosted worker builds it for real (loading the state saved at a resize, if any); the
        others construct theirs without touching the shared learning rates and adopt its state.
        """
        mine = self._workers[w.rank].schedulers
        k = len(mine)
        mine.append(sched)
        w.capture.registered.add(id(sched))   # carried here, not again as an unregistered object (capture/carried.py)
        saved = w.progress.restore.extras.get(SCHEDULERS, []) if w.progress.restore is not None else []

        led = False

        def lead() -> int:
            nonlocal led
            led = True
            if k < len(saved):
                # Resuming: the optimizer's hyperparameters were restored with it; constructing the
                # scheduler would overwrite its learning rates with those of step 0.
                with _KeepHyperparameters(opt):
                    init()
                sched.load_state_dict(copy.deepcopy(saved[k]))
            else:
                init()
            self._built.append(_Built(OncePerStep(self.runtime.hosted, "the scheduler's step()"), copy.deepcopy(sched.state_dict())))
            return len(self._built) - 1

        self._building = True
        try:
            index = self._sched_build_once.call(w.rank, lead)
            if not led:
                with _KeepHyperparameters(opt):
                    init()
                sched.load_state_dict(copy.deepcopy(self._built[index].state))
        finally:
            self._building = False
        self._sched_index[sched] = index

    def step_scheduler(self, w: Worker, sched: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                       step: Callable[[], Any]) -> Any:
        """`sched.step(...)` once per physical step; the other workers' schedulers adopt its state.

        A step inside another scheduler's step (SequentialLR, ChainedScheduler) is part of that one
        logical call and runs as is.
        """
        index = self._sched_index.get(sched)
        if index is None or self._stepping:
            return step()
        led = False

        def lead() -> tuple[tuple[Any, ...], dict[str, Any], dict[str, Any]]:
            nonlocal led
            led = True
            self._stepping = True
            try:
                step()
            finally:
                self._stepping = False
            return args, kwargs, copy.deepcopy(sched.state_dict())

        lead_args, lead_kwargs, state = self._built[index].step_once.call(w.rank, lead)
        if not led:
            if not _same((args, kwargs), (lead_args, lead_kwargs)):
                raise RuntimeError(
                    f"elasticd: {type(sched).__name__}.step() got different arguments on logical rank {w.rank} "
                    f"({args}, {kwargs}) than on rank {self.runtime.hosted[0]} ({lead_args}, {lead_kwargs}): "
                    f"under DDP the ranks' learning rates would drift apart, while here they share one; pass "
                    f"a value that is the same on every rank (e.g. a metric averaged with ctx.all_reduce)")
            sched.load_state_dict(copy.deepcopy(state))
        return None

    @property
    def building_scheduler(self) -> bool:
        return self._building

    # -- GradScaler -----------------------------------------------------------------------------
    def built_scaler(self, w: Worker, scaler: Any) -> None:
        """A GradScaler built in a worker: resumed from the resize snapshot, kept for the next one."""
        mine = self._workers[w.rank].scalers
        k = len(mine)
        mine.append(scaler)
        w.capture.registered.add(id(scaler))  # carried here, not again as an unregistered object (capture/carried.py)
        saved = w.progress.restore.extras.get(SCALERS, []) if w.progress.restore is not None else []
        if k < len(saved) and saved[k]:
            scaler.load_state_dict(saved[k])

    def unscale_(self, w: Worker, scaler: Any, optimizer: torch.optim.Optimizer, unscale: Callable[[], None]) -> None:
        """`scaler.unscale_(optimizer)` once per physical step, on the averaged gradient.

        The first worker unscales the shared `.grad`; every other worker's scaler records the inf/nan
        findings it made, as if it had unscaled the same gradient itself (as every DDP rank does), so
        `scaler.step` skips or takes the step alike and every scaler's `update` reaches the same scale.
        """
        led = False

        def lead() -> dict[Any, torch.Tensor]:
            nonlocal led
            led = True
            unscale()
            return {d: t.clone() for d, t in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].items()}

        found = self.unscale_once.call(w.rank, lead)
        if led:
            return
        # GradScaler.unscale_'s own bookkeeping, without touching the (shared, already unscaled) gradients.
        scaler._check_scale_growth_tracker("unscale_")
        state = scaler._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        state["found_inf_per_device"] = {d: t.clone() for d, t in found.items()}
        state["stage"] = OptState.UNSCALED

    # -- resize ---------------------------------------------------------------------------------
    def worker_extras(self, w: Worker) -> dict[str, Any]:
        """What a resize must carry for this worker besides the groups: its schedulers' and scalers' state."""
        mine = self._workers[w.rank]
        return {SCHEDULERS: [copy.deepcopy(s.state_dict()) for s in mine.schedulers],
                SCALERS: [s.state_dict() for s in mine.scalers]}


class _KeepHyperparameters:
    """Put an optimizer's hyperparameters back after a scheduler's constructor rewrote them."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        self._opt = opt

    def __enter__(self) -> None:
        self._saved = _hyperparameters(self._opt)

    def __exit__(self, *exc: object) -> None:
        for g, saved in zip(self._opt.param_groups, self._saved, strict=True):
            g.update(saved)


def _same(a: Any, b: Any) -> bool:
    """Equal as step() arguments: tensors by value, containers element-wise, the rest by ==."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - incomparable values are not the same
        return False
