"""What workers get back from `ctx.replicate`: the shared optimizer and scheduler, updated once per step.

The optimizer view is a `torch.optim.Optimizer` (as HF Accelerate's wrapped optimizer is), so libraries
that check `isinstance` — LR schedulers, `GradScaler`, user code — accept it. It never runs
`Optimizer.__init__`: it has no state of its own, and `param_groups`, `state`, `defaults`, hooks and
`state_dict` are the inner optimizer's, so schedulers write the one shared learning rate.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from elasticd.agent.replicated.write_once import shared_groups

if TYPE_CHECKING:
    from elasticd.agent.replicated.group import ReplicatedGroup
    from elasticd.agent.runtime import Runtime


class ReplicatedOptimizer(torch.optim.Optimizer):
    """The shared optimizer as a worker sees it: `step` and `zero_grad` run once per physical step."""

    # GradScaler's fused path (fused optimizers) checks the shared gradient for infs in every worker's
    # `scaler.step`, when later workers' view of it is the next step's partial sum. Declining it makes
    # the scaler unscale through `unscale_`, which runs once per step (idioms.py); fused steps still run.
    _step_supports_amp_scaling = False

    def __init__(self, group: ReplicatedGroup, runtime: Runtime) -> None:  # noqa: D107 - no Optimizer.__init__
        # Deliberately not Optimizer.__init__: every piece of optimizer state lives in the inner one.
        self._group = group
        self._runtime = runtime
        self._inner = group.optimizer

    # The inner optimizer's state, read and written through (schedulers assign lr into param_groups).
    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:
        return shared_groups(self._inner)   # a worker's `g["lr"] *= k` is made once (write_once.py)

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._inner.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:
        return self._inner.state

    @state.setter
    def state(self, value: Any) -> None:
        self._inner.state = value

    @property  # type: ignore[override]
    def defaults(self) -> dict[str, Any]:
        return self._inner.defaults

    @property
    def inner(self) -> torch.optim.Optimizer:
        """The optimizer `ctx.replicate` was given (the first hosted worker's)."""
        return self._inner

    @property
    def group(self) -> ReplicatedGroup:
        return self._group

    def step(self, closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:  # type: ignore[override]
        if closure is not None:
            # The closure runs forward and backward again inside the step (LBFGS's line search), once per
            # evaluation on every rank; a step the hosted workers share runs once, so it cannot call each one's.
            raise NotImplementedError(
                "elasticd: optimizer.step(closure) (LBFGS and other optimizers that evaluate the loss again inside "
                "their step) is not supported on an optimizer ctx.replicate returned: its step runs once for every "
                "hosted worker, and the closure is each worker's own. Keep the model and optimizer each worker's "
                "own instead: wrap the model in torch's DistributedDataParallel inside the function and build the "
                "optimizer on it (no ctx.replicate); each worker then steps with its closure as a DDP rank does")
        rank = self._runtime.current_rank()
        return self._group.step_once.call(rank, lambda: self._step(rank, kwargs))

    def _step(self, rank: int, kwargs: dict[str, Any]) -> Any:
        self._runtime.replicated.swaps.commit(rank)   # it steps what this worker set through .data
        return self._inner.step(**kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        rank = self._runtime.current_rank()
        self._group.zero_once.call(rank, lambda: self._inner.zero_grad(set_to_none=set_to_none))

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        # Every hosted worker loads the same checkpoint; loading it once per worker gives the same state.
        self._inner.load_state_dict(state_dict)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "elasticd: add_param_group on a replicated optimizer is not supported: parameters added after "
            "ctx.replicate would not have their gradients averaged; build the optimizer with every "
            "parameter group before calling ctx.replicate")

    def __getattr__(self, name: str) -> Any:
        # Only reached for names the view does not have: hooks dicts, `_step_supports_amp_scaling`, ...
        if name in ("_inner", "_group", "_runtime"):
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("elasticd: a replicated optimizer cannot be pickled; save optimizer.state_dict() instead")

    def __repr__(self) -> str:
        return f"Replicated({self._inner!r})"


class ReplicatedScheduler:
    """The shared LR scheduler passed to `ctx.replicate`: `step` runs once per physical step."""

    def __init__(self, group: ReplicatedGroup, runtime: Runtime) -> None:
        self._group = group
        self._runtime = runtime
        self._inner = group.scheduler

    def step(self, *args: Any, **kwargs: Any) -> None:
        rank = self._runtime.current_rank()
        self._group.sched_once.call(rank, lambda: self._inner.step(*args, **kwargs))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return f"Replicated({self._inner!r})"
