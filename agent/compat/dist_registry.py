"""The table of `torch.distributed` functions made logical inside workers, and what their halves share.

compat/torch_dist.py installs the table (and holds the default group's functions and DDP); the rooted,
object, point-to-point and subgroup functions register into it from modules of their own. Each entry runs
torch's own function outside worker threads and the logical one inside them; a call naming a subgroup of the
logical world goes to compat/dist_groups.py, which registers itself in `SUBGROUPS` when it loads (it imports
this module, never the other way round).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from elasticd.agent.comm.collectives import AllGather
from elasticd.agent.slicer.context import Work, runtime_of, worker_of
from elasticd.agent.worker import current_worker, worker_in_backward

if TYPE_CHECKING:
    from elasticd.agent.slicer.context import WorkerContext


class _Subgroups:
    """Where a call on a subgroup goes (compat/dist_groups.py fills it in)."""

    def __init__(self) -> None:
        self.is_group: Callable[[Any], bool] = lambda _x: False
        self.call: Callable[..., Any] | None = None


SUBGROUPS = _Subgroups()

_REDUCE_OPS = (
    (dist.ReduceOp.SUM, "sum"), (dist.ReduceOp.AVG, "avg"), (dist.ReduceOp.PRODUCT, "product"),
    (dist.ReduceOp.MIN, "min"), (dist.ReduceOp.MAX, "max"),
)
PATCHES: dict[str, Callable[..., Any]] = {}  # torch.distributed name -> its worker-aware replacement
# What torch answers with no default group as well; everything else raises there, and does here.
_WITHOUT_GROUP = frozenset({"is_initialized", "init_process_group", "destroy_process_group"})


def worker_ctx() -> WorkerContext | None:
    w = current_worker()
    return None if w is None else w.ctx


def op_name(op: Any) -> str:
    for known, name in _REDUCE_OPS:
        if op == known:  # RedOpType and ReduceOp instances both compare equal to the enum members
            return name
    raise NotImplementedError(f"elasticd: reduce op {op!r} is not supported over logical ranks "
                              f"(supported: SUM, AVG, PRODUCT, MIN, MAX)")


def check_group(group: Any, fn: str) -> None:
    # With M > 1 agents `group.WORLD` is the physical group object; user code means the logical world.
    if group is None or group is c10d.GroupMember.WORLD:
        return
    raise NotImplementedError(
        f"elasticd: torch.distributed.{fn} on a process group elasticd did not make is not supported inside an "
        f"elastic function; the default group is the logical world of N workers, and new_group makes subgroups "
        f"of it"
    )


def logical(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register `impl(ctx, *args, **kwargs)` as the in-worker behaviour of `torch.distributed.<name>`."""
    original = getattr(c10d, name)

    def register(impl: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def patched(*args: Any, **kwargs: Any) -> Any:
            ctx = worker_ctx()
            if ctx is None:
                if name not in _ASKS:
                    _refuse_inside_backward(name)
                return original(*args, **kwargs)
            if worker_of(ctx).dist.initialized is False and name not in _WITHOUT_GROUP:
                # torch's own answer outside an initialized world (before init, after destroy)
                raise ValueError(f"Default process group has not been initialized, please make sure to call "
                                 f"init_process_group. (elasticd: torch.distributed.{name} in logical rank {ctx.rank})")
            if SUBGROUPS.call is not None and any(SUBGROUPS.is_group(x) for x in (*args, *kwargs.values())):
                return SUBGROUPS.call(name, original, ctx, args, kwargs)   # a subgroup's collective
            return impl(ctx, *args, **kwargs)

        patched.__elasticd_logical__ = True  # type: ignore[attr-defined]
        PATCHES[name] = patched
        return impl

    return register


# Questions, not communication: a library asking from a thread of its own (a loader's, a logger's) while a
# worker's backward runs gets torch's answer, as before.
_ASKS = frozenset({"is_initialized", "get_rank", "get_world_size", "get_backend"})


def _refuse_inside_backward(name: str) -> None:
    """A call from a thread that is no worker's while a worker's backward pass runs: autograd's CUDA device
    thread, running a backward function that communicates (SyncBatchNorm's all_reduce). It would reach the
    agents' own group, over M agents instead of N ranks, and cannot wait for the other hosted workers: their
    backward passes need that same thread. Loudly, rather than a sum over the wrong ranks."""
    w = worker_in_backward()
    if w is not None:
        raise RuntimeError(
            f"elasticd: torch.distributed.{name} was called from a thread of its own during logical rank {w.rank}'s "
            f"backward pass (autograd runs a CUDA backward pass on a device thread; SyncBatchNorm and autograd "
            f"Functions that communicate in backward do this). Collectives inside a backward pass are not supported: "
            f"use BatchNorm instead of SyncBatchNorm, or communicate before or after backward")


class DeliverWork(Work):
    """A handle whose op's result is written into the caller's output tensors when the flush completes it."""

    def __init__(self, runtime: Any, op: Any, deliver: Callable[[Any], None]) -> None:
        super().__init__(runtime, op)
        self._deliver = deliver

    def _complete(self) -> None:
        self._deliver(self._op.result)
        super()._complete()


def gather_all(ctx: WorkerContext, tensor: torch.Tensor, async_op: bool,
            deliver: Callable[[list[torch.Tensor]], None]) -> Work | None:
    op = AllGather(ctx.rank, tensor=tensor)
    work = DeliverWork(runtime_of(ctx), op, deliver)
    runtime_of(ctx).enqueue(worker_of(ctx), op, work)
    if async_op:
        return work
    work.wait()
    return None


def root(ctx: WorkerContext, given: int | None, group_given: int | None, what: str, fn: str) -> int:
    """The root rank of a call: `dst`/`src`, or `group_dst`/`group_src` (the same on the default group)."""
    r = given if given is not None else group_given
    if r is None:
        r = 0
    if not 0 <= r < ctx.world_size:
        raise ValueError(f"{fn}: {what}={r} is not a logical rank of {ctx.world_size}")
    return r


def run(ctx: WorkerContext, op: Any, async_op: bool, deliver: Any = None) -> Work | None:
    """Queue `op`; `deliver(op)` runs when the flush completes it. Waits unless `async_op`."""
    work = DeliverWork(runtime_of(ctx), op, (lambda _result: deliver(op)) if deliver else (lambda _result: None))
    runtime_of(ctx).enqueue(worker_of(ctx), op, work)
    if async_op:
        return work
    work.wait()
    return None
