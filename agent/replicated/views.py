"""What workers get back from `ctx.replicate`: the shared optimizer and scheduler, updated once per step."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elasticd.agent.replicated.group import ReplicatedGroup
    from elasticd.agent.slicer.runtime import Runtime


class ReplicatedOptimizer:
    """The shared optimizer as a worker sees it: `step` and `zero_grad` run once per physical step."""

    def __init__(self, group: ReplicatedGroup, runtime: Runtime) -> None:
        self._group = group
        self._runtime = runtime
        self._inner = group.optimizer

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if closure is not None:
            raise NotImplementedError("elasticd: optimizer.step(closure) is not supported for replicated optimizers")
        rank = self._runtime.current_rank()
        return self._group.step_once.call(rank, self._inner.step)

    def zero_grad(self, set_to_none: bool = True) -> None:
        rank = self._runtime.current_rank()
        self._group.zero_once.call(rank, lambda: self._inner.zero_grad(set_to_none=set_to_none))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __repr__(self) -> str:
        return f"Replicated({self._inner!r})"


class ReplicatedScheduler:
    """The shared LR scheduler: `step` runs once per physical step."""

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
