"""`torch.distributed` inside the decorated function addresses the logical world of N workers.

Code written for DDP calls `dist.get_rank()`, `dist.all_reduce(...)` and wraps its model in
`DistributedDataParallel`. Inside a worker thread those must mean logical rank r of N, not agent p of
M, so the agent replaces the `torch.distributed` functions below with versions that route to the
runtime's logical collectives in worker threads and call the originals everywhere else. The default group
is the logical world, and `new_group` makes subgroups of it (compat/dist_groups.py). This module holds the
default group's own functions, DDP and the installer; the rooted and all-to-all functions
(compat/dist_rooted.py), the object collectives (compat/dist_objects.py) and point-to-point messages
(compat/dist_p2p.py) register into the same table (compat/dist_registry.py).

What is patched, and what is not:
- the `torch.distributed.<name>` attributes (what `dist.all_reduce` looks up at call time). The
  functions inside `torch.distributed.distributed_c10d` are never touched: agent/comm/physical.py calls
  those, so the agents' own collectives, which run in worker threads during a flush, stay physical.
- `torch.nn.parallel.DistributedDataParallel` (and `torch.nn.parallel.distributed.…`) become a class
  that builds a `LogicalDDP` in worker threads and torch's own DDP elsewhere. The real reducer cannot
  be used: it blocks inside the autograd engine, whose device threads every worker shares.
- names a module bound before `install` (`from torch.nn.parallel import DistributedDataParallel as
  DDP`) are rebound by `install(fn)` in every module already imported outside torch and elasticd (the
  function's and its helpers'). The agent process installs before importing the script, so there it
  only matters for standalone runs (`python script.py`).
- torchrun's process-group lifecycle: `init_process_group` (any backend, env:// or not) checks what it
  is asked against the logical world and forms nothing; `is_initialized` and `destroy_process_group`
  follow it per worker; the agents' own group is never touched by them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
import torch.nn.parallel
import torch.nn.parallel.distributed as ddp_module

from elasticd.agent import patches
from elasticd.agent.compat import dist_groups, dist_objects, dist_p2p, dist_rooted  # noqa: F401 - they register
from elasticd.agent.compat.dist_registry import (
    PATCHES,
    check_group,
    gather_all,
    logical,
    op_name,
    worker_ctx,
)
from elasticd.agent.compat.logical_ddp import LogicalDDP
from elasticd.agent.slicer.context import Work, worker_of

if TYPE_CHECKING:
    from elasticd.agent.slicer.context import WorkerContext

# Captured before anything here patches it (install() rebinds the module attributes, not this name).
RealDDP = ddp_module.DistributedDataParallel

# -- the logical world ----------------------------------------------------------------------------

@logical("is_initialized")
def _is_initialized(ctx: WorkerContext) -> bool:
    # The logical world exists even when a single agent has no process group: an @elastic function sees it
    # initialized (None) until it destroys it; a torchrun-mode script (False) once it calls init_process_group.
    return worker_of(ctx).dist.initialized is not False


@logical("init_process_group")
def _init_process_group(ctx: WorkerContext, backend: Any = None, init_method: Any = None, timeout: Any = None,
                        world_size: int = -1, rank: int = -1, store: Any = None, group_name: str = "",
                        pg_options: Any = None, device_id: Any = None, **_: Any) -> None:
    """No process group to form: the logical world is there. What the call asks is checked against it, so a
    script that meant another world fails here instead of computing with this one."""
    if worker_of(ctx).dist.initialized:
        raise ValueError("trying to initialize the default process group twice!")
    if world_size not in (-1, None) and world_size != ctx.world_size:
        raise ValueError(f"elasticd: init_process_group(world_size={world_size}) in a job of {ctx.world_size} "
                         f"logical workers")
    if rank not in (-1, None) and rank != ctx.rank:
        raise ValueError(f"elasticd: init_process_group(rank={rank}) called by logical rank {ctx.rank}")
    worker_of(ctx).dist.initialized = True
    worker_of(ctx).dist.backend = str(backend).lower() if backend else None


@logical("destroy_process_group")
def _destroy_process_group(ctx: WorkerContext, group: Any = None) -> None:
    check_group(group, "destroy_process_group")  # the agents' own group is the runtime's to close
    worker_of(ctx).dist.initialized = False


@logical("get_backend")
def _get_backend(ctx: WorkerContext, group: Any = None) -> str:
    check_group(group, "get_backend")
    if worker_of(ctx).dist.backend:
        return worker_of(ctx).dist.backend
    return "nccl" if ctx.device.type == "cuda" else "gloo"


@logical("get_rank")
def _get_rank(ctx: WorkerContext, group: Any = None) -> int:
    check_group(group, "get_rank")
    return ctx.rank


@logical("get_world_size")
def _get_world_size(ctx: WorkerContext, group: Any = None) -> int:
    check_group(group, "get_world_size")
    return ctx.world_size


@logical("new_group")
def _new_group(ctx: WorkerContext, ranks: list[int] | None = None, *args: Any, **kwargs: Any) -> Any:
    return dist_groups.new_group(ctx, ranks, sort_ranks=kwargs.get("sort_ranks", True))


@logical("new_subgroups")
def _new_subgroups(ctx: WorkerContext, group_size: int | None = None, group: Any = None, *args: Any,
                   **kwargs: Any) -> Any:
    return dist_groups.new_subgroups(ctx, group_size, group)


@logical("get_process_group_ranks")
def _get_process_group_ranks(ctx: WorkerContext, group: Any) -> list[int]:
    check_group(group, "get_process_group_ranks")
    return list(range(ctx.world_size))


@logical("get_group_rank")
def _get_group_rank(ctx: WorkerContext, group: Any, global_rank: int) -> int:
    check_group(group, "get_group_rank")
    return global_rank


@logical("get_global_rank")
def _get_global_rank(ctx: WorkerContext, group: Any, group_rank: int) -> int:
    check_group(group, "get_global_rank")
    return group_rank


@logical("all_reduce")
def _all_reduce(ctx: WorkerContext, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None,
                async_op: bool = False) -> Work | None:
    check_group(group, "all_reduce")
    return ctx.all_reduce(tensor, op=op_name(op), async_op=async_op)


@logical("broadcast")
def _broadcast(ctx: WorkerContext, tensor: torch.Tensor, src: int | None = None, group: Any = None,
               async_op: bool = False, group_src: int | None = None) -> Work | None:
    check_group(group, "broadcast")
    root = src if src is not None else group_src  # the default group's ranks are the global ones
    if root is None:
        raise ValueError("broadcast needs src (or group_src)")
    return ctx.broadcast(tensor, root, async_op=async_op)


@logical("all_gather")
def _all_gather(ctx: WorkerContext, tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
                async_op: bool = False) -> Work | None:
    check_group(group, "all_gather")
    if len(tensor_list) != ctx.world_size:
        raise ValueError(f"all_gather needs a list of {ctx.world_size} tensors, got {len(tensor_list)}")

    def deliver(every: list[torch.Tensor]) -> None:
        for out, t in zip(tensor_list, every, strict=True):
            out.copy_(t)

    return gather_all(ctx, tensor, async_op, deliver)


@logical("all_gather_into_tensor")
def _all_gather_into_tensor(ctx: WorkerContext, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                            group: Any = None, async_op: bool = False) -> Work | None:
    check_group(group, "all_gather_into_tensor")
    if output_tensor.numel() != ctx.world_size * input_tensor.numel():
        raise ValueError(f"all_gather_into_tensor: output must hold {ctx.world_size} x the input's "
                         f"{input_tensor.numel()} elements, got {output_tensor.numel()}")

    def deliver(every: list[torch.Tensor]) -> None:
        # Concatenated or stacked along dim 0: the same memory order either way.
        output_tensor.copy_(torch.stack(every).reshape(output_tensor.shape))

    return gather_all(ctx, input_tensor, async_op, deliver)


@logical("reduce_scatter")
def _reduce_scatter(ctx: WorkerContext, output: torch.Tensor, input_list: list[torch.Tensor],
                    op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Work | None:
    check_group(group, "reduce_scatter")
    return ctx.reduce_scatter(output, list(input_list), op=op_name(op), async_op=async_op)


@logical("reduce_scatter_tensor")
def _reduce_scatter_tensor(ctx: WorkerContext, output: torch.Tensor, input: torch.Tensor,
                           op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False) -> Work | None:
    check_group(group, "reduce_scatter_tensor")
    return ctx.reduce_scatter(output, input, op=op_name(op), async_op=async_op)


@logical("barrier")
def _barrier(ctx: WorkerContext, group: Any = None, async_op: bool = False, device_ids: Any = None,
             timeout: Any = None) -> Work | None:
    check_group(group, "barrier")
    return ctx.barrier(async_op=async_op)


# torch 2.13 renames the tensor forms (the old names warn); code uses both.
if hasattr(c10d, "all_gather_single"):
    logical("all_gather_single")(_all_gather_into_tensor)
if hasattr(c10d, "reduce_scatter_single"):
    logical("reduce_scatter_single")(_reduce_scatter_tensor)


# -- the rest of the API, in modules of their own ------------------------------------------------------


# -- DistributedDataParallel ----------------------------------------------------------------------

class _DDPMeta(type(RealDDP)):  # type: ignore[misc]  # ABCMeta: DDP is a Joinable
    """Makes `DistributedDataParallel(...)` pick the implementation by thread, and keeps isinstance sensible."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        in_worker = worker_ctx() is not None
        if cls is _PROXY:
            return LogicalDDP(*args, **kwargs) if in_worker else RealDDP(*args, **kwargs)
        if in_worker:  # a user subclass would need the real reducer
            raise NotImplementedError(f"elasticd: subclasses of DistributedDataParallel ({cls.__name__}) "
                                      f"are not supported inside an elastic function")
        return super().__call__(*args, **kwargs)

    def __instancecheck__(cls, obj: Any) -> bool:
        if cls is _PROXY:
            return cls.__subclasscheck__(type(obj))
        return super().__instancecheck__(obj)

    def __subclasscheck__(cls, sub: type) -> bool:
        if cls is _PROXY:
            # By MRO, not issubclass: RealDDP's ABC check walks its subclasses, this class among them.
            mro = getattr(sub, "__mro__", ())
            return RealDDP in mro or LogicalDDP in mro
        return super().__subclasscheck__(sub)

    def __setattr__(cls, name: str, value: Any) -> None:
        # torch's DDP keeps class-level state (`_active_ddp_module`) written through the module-level
        # name, which now means this class: store it on the real class, where its readers look.
        if cls is _PROXY:
            setattr(RealDDP, name, value)
        else:
            super().__setattr__(name, value)


_PROXY: type | None = None  # set below: while the class is being created its own setup must stay on it


class DistributedDataParallel(RealDDP, metaclass=_DDPMeta):
    """torch's DDP outside elasticd workers; `elasticd.agent.compat.logical_ddp.LogicalDDP` inside them."""


_PROXY = DistributedDataParallel


# -- installing -----------------------------------------------------------------------------------

_LEDGER = patches.ledger("compat.torch_dist")


def install(fn: Callable[..., Any] | None = None) -> None:
    """Patch torch.distributed and DDP in this process (idempotent); rebind names in `fn`'s module."""
    if not _LEDGER.active:
        for name, patched in PATCHES.items():
            _LEDGER.set(dist, name, patched)
        dist_p2p.install()   # P2POp(dist.isend, ...) inside workers
        _LEDGER.set(torch.nn.parallel, "DistributedDataParallel", DistributedDataParallel)
        _LEDGER.set(ddp_module, "DistributedDataParallel", DistributedDataParallel)
    namespace = getattr(fn, "__globals__", None)
    if namespace is not None:
        rebind(namespace)
    rebind_loaded()


# torch's own modules must keep the real functions (agent/comm/physical.py reaches them from worker threads
# during a flush), and ours know which they mean.
_KEEP = ("torch", "elasticd", "builtins")


def rebind_loaded() -> None:
    """`rebind` every module already imported outside torch and elasticd.

    A standalone run (`python script.py`) installs only when the decorated function is called, after the
    script and its helpers ran `from torch.nn.parallel import DistributedDataParallel as DDP`: a helper
    module holding the real class would build torch's DDP inside a worker ("Default process group has not
    been initialized"). The agent process installs before the script loads; this covers the rest.
    """
    replacements = _replacements()   # once: hundreds of modules are loaded (numpy, sympy, the script's)
    for name, module in list(sys.modules.items()):
        if module is None or name.partition(".")[0] in _KEEP:
            continue
        try:
            namespace = getattr(module, "__dict__", None)
        except Exception:  # noqa: BLE001 - a lazy module that cannot load now holds no name of ours yet
            continue
        if isinstance(namespace, dict):
            rebind(namespace, replacements)


def _replacements() -> dict[int, Any]:
    replacements: dict[int, Any] = {id(RealDDP): DistributedDataParallel}
    replacements.update({id(getattr(c10d, name)): patched for name, patched in PATCHES.items()})
    return replacements


def rebind(namespace: dict[str, Any], replacements: dict[int, Any] | None = None) -> None:
    """Point names bound to the unpatched objects (`from torch.distributed import all_reduce`) at the patches."""
    replacements = _replacements() if replacements is None else replacements
    for key, value in list(namespace.items()):
        new = replacements.get(id(value))
        if new is not None:
            _LEDGER.set_item(namespace, key, new)
