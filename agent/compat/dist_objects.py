"""`torch.distributed`'s object collectives on the logical world: broadcast_object_list, all_gather_object,
gather_object and scatter_object_list (comm/objects.py carries the pickles). Registered into
the table of compat/dist_registry.py.

Every receiver gets its own unpickled copy, as a separate process would, so two workers of one agent never
share a received object; the source of a broadcast keeps its own objects, as under torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from elasticd.agent.comm.objects import Exchange, dumps, loads
from elasticd.agent.compat.dist_registry import check_group, logical, root, run

if TYPE_CHECKING:
    from elasticd.agent.slicer.context import WorkerContext


def _exchange(ctx: WorkerContext, what: str, payload: Any) -> list[bytes]:
    op = Exchange(ctx.rank, what=what, payload=dumps(payload))
    run(ctx, op, False)
    return op.result


def _device(device: Any) -> torch.device | None:
    return torch.device(device) if device is not None else None


@logical("broadcast_object_list")
def _broadcast_object_list(ctx: WorkerContext, object_list: list[Any], src: int | None = None, group: Any = None,
                           device: Any = None, group_src: int | None = None) -> None:
    check_group(group, "broadcast_object_list")
    frm = root(ctx, src, group_src, "src", "broadcast_object_list")
    every = _exchange(ctx, "broadcast_object_list", list(object_list) if ctx.rank == frm else None)
    if ctx.rank != frm:
        got = loads(every[frm], _device(device))
        if len(got) != len(object_list):
            raise ValueError(f"broadcast_object_list: logical rank {frm} broadcast {len(got)} objects into a list "
                             f"of {len(object_list)} on rank {ctx.rank}")
        object_list[:] = got


@logical("all_gather_object")
def _all_gather_object(ctx: WorkerContext, object_list: list[Any], obj: Any, group: Any = None) -> None:
    check_group(group, "all_gather_object")
    if len(object_list) != ctx.world_size:
        raise ValueError(f"all_gather_object needs an object_list of {ctx.world_size}, got {len(object_list)}")
    for i, blob in enumerate(_exchange(ctx, "all_gather_object", obj)):
        object_list[i] = loads(blob)


@logical("gather_object")
def _gather_object(ctx: WorkerContext, obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                   group: Any = None, group_dst: int | None = None) -> None:
    check_group(group, "gather_object")
    to = root(ctx, dst, group_dst, "dst", "gather_object")
    if ctx.rank == to and (object_gather_list is None or len(object_gather_list) != ctx.world_size):
        raise ValueError(f"gather_object: the destination rank {to} must pass an object_gather_list of "
                         f"{ctx.world_size}")
    every = _exchange(ctx, "gather_object", obj)
    if ctx.rank == to and object_gather_list is not None:
        for i, blob in enumerate(every):
            object_gather_list[i] = loads(blob)


@logical("scatter_object_list")
def _scatter_object_list(ctx: WorkerContext, scatter_object_output_list: list[Any],
                         scatter_object_input_list: list[Any] | None = None, src: int | None = None,
                         group: Any = None, group_src: int | None = None) -> None:
    check_group(group, "scatter_object_list")
    frm = root(ctx, src, group_src, "src", "scatter_object_list")
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError("Expected argument scatter_object_output_list to be a list of size at least 1.")
    payload = None
    if ctx.rank == frm:
        if scatter_object_input_list is None or len(scatter_object_input_list) != ctx.world_size:
            raise ValueError(f"scatter_object_list: the source rank {frm} must pass {ctx.world_size} objects")
        payload = [dumps(o) for o in scatter_object_input_list]
    every = _exchange(ctx, "scatter_object_list", payload)
    scatter_object_output_list[0] = loads(loads(every[frm])[ctx.rank])
