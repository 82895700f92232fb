"""Replicated state: one device copy of params, grads and optimizer state for every hosted worker.

In data parallelism every rank holds the same parameters and optimizer state, so an agent keeps one
copy (the one its lowest hosted rank built; agent 0's is broadcast to the others, as DDP broadcasts
rank 0's module state at construction). Hosted workers' backward passes accumulate into the shared
`.grad` (the local part of the all-reduce); the gradient flush finishes the sum over agents and
averages over N. Optimizer step, `zero_grad`, scheduler step and clipping run once per physical step;
the other hosted workers' calls return the first call's result (Singularity's "root rank runs the
update"). Buffers follow DDP's `broadcast_buffers=True`: logical rank 0's win.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from elasticd.agent.comm.collectives import Collective, FlushEnv

if TYPE_CHECKING:
    from elasticd.agent.slicer.runtime import Runtime


class OncePerStep:
    """Runs the k-th call of an operation once, however many hosted workers make their k-th call.

    Hosted workers run the same program, so their k-th calls are the same logical operation; the first
    one to arrive runs it and later ones get its result. Results are dropped once every hosted worker
    has fetched them.
    """

    def __init__(self, ranks: Iterable[int]) -> None:
        self._ranks = tuple(ranks)
        self._calls = {r: 0 for r in self._ranks}
        self._results: dict[int, list[Any]] = {}  # call index -> [result, fetches left]
        self._executed = 0

    def call(self, rank: int, fn: Callable[[], Any]) -> Any:
        k = self._calls[rank]
        self._calls[rank] = k + 1
        if k == self._executed:
            self._executed += 1
            self._results[k] = [fn(), len(self._ranks)]
        entry = self._results[k]
        entry[1] -= 1
        if entry[1] == 0:
            del self._results[k]
        return entry[0]


class ReplicatedGroup:
    """One `ctx.replicate(...)` call site: a shared model with its optimizer and scheduler."""

    def __init__(self, index: int, runtime: Runtime, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None, scheduler: Any | None) -> None:
        self.index = index
        self.runtime = runtime
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.params = [p for p in model.parameters() if p.requires_grad]
        if optimizer is not None:
            known = {id(p) for p in self.params}
            stray = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in known]
            if stray:
                raise ValueError("ctx.replicate: the optimizer holds parameters that are not the model's; "
                                 "build the optimizer over model.parameters() before replicating")
        self.buffers = list(model.buffers())
        ranks = runtime.hosted
        self.step_once = OncePerStep(ranks)
        self.zero_once = OncePerStep(ranks)
        self.sched_once = OncePerStep(ranks)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._on_grad)
        if self.buffers:
            model.register_forward_pre_hook(self._guard_buffers)
            model.register_forward_hook(self._restore_buffers)
        self._saved_buffers: list[torch.Tensor] | None = None
        # What workers get back from ctx.replicate: views whose updates run once per physical step.
        self.opt_view = ReplicatedOptimizer(self, runtime) if optimizer is not None else None
        self.sched_view = ReplicatedScheduler(self, runtime) if scheduler is not None else None

    def _on_grad(self, _p: torch.Tensor) -> None:
        # Runs where autograd runs (an engine thread on CUDA), so ask the baton, not the thread.
        worker = self.runtime.current
        if worker is not None:
            worker.touched_grads = True

    def _guard_buffers(self, _module: torch.nn.Module, _args: Any) -> None:
        worker = self.runtime.current
        if worker is not None and worker.rank != 0:
            self._saved_buffers = [b.detach().clone() for b in self.buffers]

    def _restore_buffers(self, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if self._saved_buffers is not None:
            # Through .data: autograd saved these tensors for backward (BatchNorm's node does), and a
            # tracked in-place write would bump their version and make that backward refuse to run.
            for b, saved in zip(self.buffers, self._saved_buffers, strict=True):
                b.data.copy_(saved)
            self._saved_buffers = None

    def broadcast_state(self) -> None:
        """Make every agent start from agent 0's parameters and buffers (DDP's constructor does this)."""
        phys = self.runtime.phys
        if phys.world == 1:
            return
        with torch.no_grad():
            for tensors in _by_dtype([*self.model.parameters(), *self.buffers]).values():
                flat = torch.cat([t.detach().reshape(-1) for t in tensors])
                phys.broadcast_(flat, 0)
                _scatter_back(flat, tensors)

    def load(self, snap: Any) -> None:
        """Adopt the replicated state saved at the step boundary where the job was resized."""
        self.model.load_state_dict(snap.model)
        if self.optimizer is not None and snap.optimizer is not None:
            self.optimizer.load_state_dict(snap.optimizer)
        if self.scheduler is not None and snap.scheduler is not None:
            self.scheduler.load_state_dict(snap.scheduler)

    def sync_buffers(self) -> None:
        phys = self.runtime.phys
        if phys.world == 1 or not self.buffers:
            return
        with torch.no_grad():
            for tensors in _by_dtype(self.buffers).values():
                flat = torch.cat([t.reshape(-1) for t in tensors])
                phys.broadcast_(flat, 0)
                _scatter_back(flat, tensors)


def _by_dtype(tensors: list[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    out: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        out.setdefault(t.dtype, []).append(t)
    return out


def _scatter_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.detach().copy_(flat[offset:offset + n].view_as(t))
        offset += n


def flatten_grads(params: list[torch.Tensor]) -> torch.Tensor:
    """Gradients as one flat fp32-or-native buffer, zeros for missing grads, then one used-flag per param."""
    dtype = params[0].dtype
    parts = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in params]
    parts.append(torch.tensor([p.grad is not None for p in params], dtype=dtype, device=params[0].device))
    return torch.cat(parts)


def unflatten_grads(flat: torch.Tensor, params: list[torch.Tensor]) -> None:
    """Assign averaged gradients; a parameter no rank produced a gradient for keeps `grad=None`, as in DDP."""
    used = flat[-len(params):]
    offset = 0
    for i, p in enumerate(params):
        n = p.numel()
        p.grad = flat[offset:offset + n].view_as(p) if used[i] > 0 else None
        offset += n


@dataclass(slots=True)
class GradSync(Collective):
    """The end of a backward pass: average the replicated gradients over all N logical ranks."""

    op: ClassVar[str] = "grad_sync"
    groups: list[ReplicatedGroup] = field(default_factory=list)
    # deterministic mode: this rank's own gradients, by (group index, dtype)
    stash: dict[tuple[int, torch.dtype], torch.Tensor] | None = None

    def on_arrive(self, deterministic: bool) -> None:
        if not deterministic:
            return  # hosted gradients simply accumulate in the shared .grad
        # Keep each rank's gradient apart so the sum can be done over ranks in a fixed order.
        self.stash = {}
        for g in self.groups:
            for dtype, params in _by_dtype(g.params).items():
                self.stash[(g.index, dtype)] = flatten_grads(params)
                for p in params:
                    p.grad = None

    @classmethod
    def flush(cls, ops: list[Collective], env: FlushEnv) -> None:
        first: GradSync = ops[0]  # type: ignore[assignment]
        if env.phys.world == 1 and not env.deterministic:
            # One agent: the shared .grad already holds the sum over every rank, and a missing grad
            # already means no rank produced one. Averaging is all that is left; no flat copy needed.
            with torch.no_grad():
                for g in first.groups:
                    for p in g.params:
                        if p.grad is not None:
                            p.grad.div_(env.workers)
            return
        for g in first.groups:
            for dtype, params in _by_dtype(g.params).items():
                if env.deterministic:
                    flat = env.sum_over_ranks([o.stash[(g.index, dtype)] for o in ops])  # type: ignore[attr-defined]
                else:
                    flat = env.phys.all_reduce_(flatten_grads(params))
                flat[: -len(params)].div_(env.workers)
                unflatten_grads(flat, params)
            g.sync_buffers()


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
