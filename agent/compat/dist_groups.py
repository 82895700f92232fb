"""Subgroups of the logical world: `new_group`, `new_subgroups` and the collectives on them.

Every rank calls `new_group` in the same order (torch requires it), so the k-th group a rank makes is the
k-th everywhere: its channel. A collective on a group runs through its first rank, the leader, over
point-to-point messages on that channel (agent/comm/p2p.py): each member sends its contribution, the leader
sends every member the list of all of them, and each member computes its result from the list in group-rank
order, so reductions add up in the same order on every layout (deterministic mode keeps its bits). Members
wait for messages the way receives do, handing the baton over, so ranks outside the group run on meanwhile.
The traffic is k contributions to the leader and k lists back: made for the small groups and small tensors
scripts use subgroups for (metrics, a tensor-parallel pair), not for gradient traffic.

A rank that is not a member gets `GroupMember.NON_GROUP_MEMBER`, and its collectives on it return at once,
as under torch.
"""

from __future__ import annotations

import ctypes
import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from elasticd.agent.comm.objects import dumps, loads
from elasticd.agent.comm.p2p import PointToPoint
from elasticd.agent.compat.dist_registry import SUBGROUPS, op_name
from elasticd.agent.slicer.context import runtime_of, worker_of

if TYPE_CHECKING:
    from elasticd.agent.slicer.context import WorkerContext

IMPLS: dict[str, Callable[..., Any]] = {}   # torch.distributed name -> impl(ctx, group, arguments)


class LogicalGroup:
    """A subgroup of logical ranks, as `new_group` returns it to a member."""

    def __init__(self, channel: int, ranks: list[int], me: int) -> None:
        self.channel = channel
        self.ranks = ranks
        self._me = me
        self.group_name = f"elasticd_group_{channel}"

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        return self.ranks.index(self._me)

    def __repr__(self) -> str:
        return f"<elasticd logical group {self.channel} ranks={self.ranks}>"


def is_group(group: Any) -> bool:
    return isinstance(group, LogicalGroup) or group is c10d.GroupMember.NON_GROUP_MEMBER


# -- making groups -------------------------------------------------------------------------------------

def new_group(ctx: WorkerContext, ranks: list[int] | None = None, sort_ranks: bool = True, **_: Any) -> Any:
    n = ctx.world_size
    members = list(range(n)) if ranks is None else [int(r) for r in ranks]
    if any(not 0 <= r < n for r in members) or len(set(members)) != len(members):
        raise ValueError(f"new_group: ranks {ranks} are not distinct logical ranks of {n}")
    if sort_ranks:
        members.sort()
    channel = worker_of(ctx).dist.groups_made
    worker_of(ctx).dist.groups_made += 1
    if ctx.rank not in members:
        return c10d.GroupMember.NON_GROUP_MEMBER
    return LogicalGroup(channel, members, ctx.rank)


def new_subgroups(ctx: WorkerContext, group_size: int | None = None, group: Any = None, **_: Any) -> tuple:
    n = ctx.world_size
    size = group_size if group_size is not None else n
    if group is not None:
        raise NotImplementedError("elasticd: new_subgroups of a group other than the default one is not supported")
    if size <= 0 or n % size:
        raise ValueError(f"new_subgroups: the world size {n} must be divisible by group_size={size}")
    mine, every = None, []
    for start in range(0, n, size):
        g = new_group(ctx, list(range(start, start + size)))
        every.append(g)
        if isinstance(g, LogicalGroup):
            mine = g
    return mine, every


# -- the exchange every collective on a group is built on -----------------------------------------------

def _send_bytes(ctx: WorkerContext, data: bytes, dst: int, tag: int) -> None:
    p2p: PointToPoint = runtime_of(ctx).p2p
    p2p.send(worker_of(ctx), torch.tensor([len(data)], dtype=torch.long), dst, tag)
    p2p.send(worker_of(ctx), torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
             else torch.empty(0, dtype=torch.uint8), dst, tag)


def _recv_bytes(ctx: WorkerContext, src: int, tag: int) -> bytes:
    p2p: PointToPoint = runtime_of(ctx).p2p
    size = torch.empty(1, dtype=torch.long)
    p2p.wait(worker_of(ctx), p2p.post(worker_of(ctx), size, src, tag))
    payload = torch.empty(int(size), dtype=torch.uint8)
    p2p.wait(worker_of(ctx), p2p.post(worker_of(ctx), payload, src, tag))
    return ctypes.string_at(payload.data_ptr(), payload.numel())


def exchange(ctx: WorkerContext, g: LogicalGroup, payload: Any) -> list[Any]:
    """Every member's `payload`, in group-rank order, each unpickled as this rank's own copy."""
    tag = -1 - g.channel
    leader = g.ranks[0]
    mine = dumps(payload)
    if ctx.rank == leader:
        blobs = [mine] + [_recv_bytes(ctx, r, tag) for r in g.ranks[1:]]
        whole = dumps(blobs)
        for r in g.ranks[1:]:
            _send_bytes(ctx, whole, r, tag)
    else:
        _send_bytes(ctx, mine, leader, tag)
        blobs = loads(_recv_bytes(ctx, leader, tag))
    return [loads(b) for b in blobs]


# -- collectives -----------------------------------------------------------------------------------------

def _impl(*names: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        for name in names:
            IMPLS[name] = fn
        return fn
    return register


_COMBINE = {"sum": torch.add, "avg": torch.add, "product": torch.mul, "max": torch.maximum, "min": torch.minimum}


def _reduce(every: list[torch.Tensor], op: str, like: torch.Tensor) -> torch.Tensor:
    out = every[0].clone()
    for t in every[1:]:
        out = _COMBINE[op](out, t)
    if op == "avg":
        out = out / len(every) if out.is_floating_point() else out // len(every)
    return out.to(like.device)


def _op(a: dict[str, Any]) -> str:
    return op_name(a.get("op", dist.ReduceOp.SUM))


def _root(g: LogicalGroup, a: dict[str, Any], global_name: str, group_name: str) -> int:
    """A root given as a global rank (`src`/`dst`) or a group rank (`group_src`/`group_dst`)."""
    if a.get(global_name) is not None:
        root = a[global_name]
    elif a.get(group_name) is not None:
        root = g.ranks[a[group_name]]
    else:
        raise ValueError(f"{global_name} (or {group_name}) must be given")
    if root not in g.ranks:
        raise ValueError(f"rank {root} is not part of the group {g.ranks}")
    return root


def _done(a: dict[str, Any]) -> Any:
    return _Done() if a.get("async_op") else None


class _Done:
    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


@_impl("all_reduce")
def _all_reduce(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> Any:
    t = a["tensor"]
    t.copy_(_reduce(exchange(ctx, g, t.detach().cpu()), _op(a), t))
    return _done(a)


@_impl("reduce")
def _reduce_to(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> Any:
    t, dst = a["tensor"], _root(g, a, "dst", "group_dst")
    every = exchange(ctx, g, t.detach().cpu())
    if ctx.rank == dst:
        t.copy_(_reduce(every, _op(a), t))
    return _done(a)


@_impl("broadcast")
def _broadcast(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> Any:
    t, src = a["tensor"], _root(g, a, "src", "group_src")
    every = exchange(ctx, g, t.detach().cpu() if ctx.rank == src else None)
    t.copy_(every[g.ranks.index(src)])
    return _done(a)


@_impl("all_gather")
def _all_gather(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> Any:
    out = a["tensor_list"]
    if len(out) != g.size():
        raise ValueError(f"all_gather on a group of {g.size()} needs {g.size()} output tensors, got {len(out)}")
    for o, t in zip(out, exchange(ctx, g, a["tensor"].detach().cpu()), strict=True):
        o.copy_(t)
    return _done(a)


@_impl("all_gather_into_tensor", "all_gather_single")
def _all_gather_into_tensor(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> Any:
    out = a["output_tensor"]
    out.copy_(torch.stack(exchange(ctx, g, a["input_tensor"].detach().cpu())).reshape(out.shape))
    return _done(a)


@_impl("gather")
def _gather(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> Any:
    dst = _root(g, a, "dst", "group_dst")
    every = exchange(ctx, g, a["tensor"].detach().cpu())
    if ctx.rank == dst:
        for o, t in zip(a["gather_list"], every, strict=True):
            o.copy_(t)
    return _done(a)


@_impl("scatter")
def _scatter(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> Any:
    src = _root(g, a, "src", "group_src")
    chunks = [t.detach().cpu() for t in a["scatter_list"]] if ctx.rank == src else None
    every = exchange(ctx, g, chunks)
    a["tensor"].copy_(every[g.ranks.index(src)][g.rank()])
    return _done(a)


@_impl("reduce_scatter")
def _reduce_scatter(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> Any:
    out = a["output"]
    every = exchange(ctx, g, [t.detach().cpu() for t in a["input_list"]])
    out.copy_(_reduce([mine[g.rank()] for mine in every], _op(a), out))
    return _done(a)


@_impl("reduce_scatter_tensor", "reduce_scatter_single")
def _reduce_scatter_tensor(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> Any:
    out = a["output"]
    every = exchange(ctx, g, a["input"].detach().cpu().reshape(g.size(), *out.shape))
    out.copy_(_reduce([mine[g.rank()] for mine in every], _op(a), out))
    return _done(a)


@_impl("all_to_all_single")
def _all_to_all_single(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> Any:
    out, inp, k = a["output"], a["input"], g.size()
    ins = a.get("input_split_sizes") or [inp.shape[0] // k] * k
    outs = a.get("output_split_sizes") or [out.shape[0] // k] * k
    every = exchange(ctx, g, [c.detach().cpu() for c in inp.split(list(ins))])
    for o, mine in zip(out.split(list(outs)), every, strict=True):
        o.copy_(mine[g.rank()])
    return _done(a)


@_impl("all_to_all")
def _all_to_all(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> Any:
    every = exchange(ctx, g, [t.detach().cpu() for t in a["input_tensor_list"]])
    for o, mine in zip(a["output_tensor_list"], every, strict=True):
        o.copy_(mine[g.rank()])
    return _done(a)


@_impl("barrier", "monitored_barrier")
def _barrier(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> Any:
    exchange(ctx, g, None)
    return _done(a)


@_impl("all_gather_object")
def _all_gather_object(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> None:
    a["object_list"][:] = exchange(ctx, g, a["obj"])


@_impl("broadcast_object_list")
def _broadcast_object_list(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> None:
    src = _root(g, a, "src", "group_src")
    objs = a["object_list"]
    every = exchange(ctx, g, list(objs) if ctx.rank == src else None)
    if ctx.rank != src:
        objs[:] = every[g.ranks.index(src)]


@_impl("gather_object")
def _gather_object(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> None:
    dst = _root(g, a, "dst", "group_dst")
    every = exchange(ctx, g, a["obj"])
    if ctx.rank == dst:
        a["object_gather_list"][:] = every


@_impl("scatter_object_list")
def _scatter_object_list(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> None:
    src = _root(g, a, "src", "group_src")
    every = exchange(ctx, g, list(a["scatter_object_input_list"]) if ctx.rank == src else None)
    a["scatter_object_output_list"][0] = every[g.ranks.index(src)][g.rank()]


# -- questions about a group -------------------------------------------------------------------------------

@_impl("get_rank")
def _get_rank(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> int:
    return g.rank()


@_impl("get_world_size")
def _get_world_size(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> int:
    return g.size()


@_impl("get_backend")
def _get_backend(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> str:
    return "nccl" if ctx.device.type == "cuda" else "gloo"


@_impl("destroy_process_group")
def _destroy(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> None:
    """A logical group holds nothing to release."""


@_impl("get_process_group_ranks")
def _ranks(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> list[int]:
    return list(g.ranks)


@_impl("get_group_rank")
def _group_rank(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> int:
    r = a["global_rank"]
    if r not in g.ranks:
        raise ValueError(f"Global rank {r} is not part of group {g}")
    return g.ranks.index(r)


@_impl("get_global_rank")
def _global_rank(ctx: WorkerContext, g: LogicalGroup, a: dict[str, Any]) -> int:
    return g.ranks[a["group_rank"]]


# What a rank outside a group gets from calls on it (torch's answers).
NON_MEMBER = {"get_rank": -1, "get_world_size": -1}


def call(name: str, original: Callable[..., Any], ctx: WorkerContext, args: tuple, kwargs: dict) -> Any:
    """Run torch.distributed.`name` on the group among its arguments."""
    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.apply_defaults()
    a = dict(bound.arguments)
    group = a.get("group", a.get("process_group"))
    if group is c10d.GroupMember.NON_GROUP_MEMBER:
        return NON_MEMBER.get(name)
    impl = IMPLS.get(name)
    if impl is None:
        raise NotImplementedError(f"elasticd: torch.distributed.{name} on a subgroup is not supported")
    return impl(ctx, group, a)


SUBGROUPS.is_group = is_group
SUBGROUPS.call = call
