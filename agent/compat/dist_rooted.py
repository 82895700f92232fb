"""`torch.distributed`'s rooted and all-to-all collectives on the logical world: reduce, gather, scatter,
all_to_all, all_to_all_single, the coalesced forms and monitored_barrier (comm/rooted.py and
comm/objects.py do the work). Registered into the table of compat/dist_registry.py.

Checks follow torch's: a destination passes the list it gathers into and only it does; a source passes the
chunks it scatters and only it does; an `async_op` caller gets a handle whose `wait()` delivers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from elasticd.agent.comm.objects import Exchange, dumps, loads
from elasticd.agent.comm.rooted import AllToAll, GatherTo, Reduce, Scatter
from elasticd.agent.compat.dist_registry import check_group, gather_all, logical, op_name, root, run
from elasticd.agent.slicer.context import Work

if TYPE_CHECKING:
    from elasticd.agent.slicer.context import WorkerContext


@logical("reduce")
def _reduce(ctx: WorkerContext, tensor: torch.Tensor, dst: int | None = None, op: Any = dist.ReduceOp.SUM,
            group: Any = None, async_op: bool = False, group_dst: int | None = None) -> Work | None:
    check_group(group, "reduce")
    to = root(ctx, dst, group_dst, "dst", "reduce")
    return run(ctx, Reduce(ctx.rank, tensor=tensor, dst=to, reduce_op=op_name(op)), async_op)


@logical("gather")
def _gather(ctx: WorkerContext, tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None,
            dst: int | None = None, group: Any = None, async_op: bool = False,
            group_dst: int | None = None) -> Work | None:
    check_group(group, "gather")
    to = root(ctx, dst, group_dst, "dst", "gather")
    if ctx.rank == to:
        if gather_list is None or len(gather_list) != ctx.world_size:
            raise ValueError(f"gather: the destination rank {to} must pass a gather_list of {ctx.world_size} tensors")
    elif gather_list:
        raise ValueError("Argument ``gather_list`` must NOT be specified on non-destination ranks.")

    def deliver(op: GatherTo) -> None:
        if op.result is not None and gather_list is not None:
            for out, t in zip(gather_list, op.result, strict=True):
                out.copy_(t)

    return run(ctx, GatherTo(ctx.rank, tensor=tensor, dst=to), async_op, deliver)


@logical("scatter")
def _scatter(ctx: WorkerContext, tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None,
             src: int | None = None, group: Any = None, async_op: bool = False,
             group_src: int | None = None) -> Work | None:
    check_group(group, "scatter")
    frm = root(ctx, src, group_src, "src", "scatter")
    chunks = None
    if ctx.rank == frm:
        if scatter_list is None or len(scatter_list) != ctx.world_size:
            raise ValueError(f"scatter: the source rank {frm} must pass a scatter_list of {ctx.world_size} tensors")
        if any(t.shape != tensor.shape or t.dtype != tensor.dtype for t in scatter_list):
            raise ValueError(f"scatter: every tensor of scatter_list must be shaped like the output "
                             f"{tuple(tensor.shape)} {tensor.dtype}")
        chunks = torch.stack([t.detach() for t in scatter_list])
    elif scatter_list:
        raise ValueError("Argument ``scatter_list`` must NOT be specified on non-source ranks.")
    return run(ctx, Scatter(ctx.rank, tensor=tensor, src=frm, chunks=chunks), async_op)


def _uniform(tensors: list[torch.Tensor]) -> bool:
    return all(t.shape == tensors[0].shape and t.dtype == tensors[0].dtype for t in tensors)


@logical("all_to_all")
def _all_to_all(ctx: WorkerContext, output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
                group: Any = None, async_op: bool = False) -> Work | None:
    check_group(group, "all_to_all")
    n = ctx.world_size
    if len(output_tensor_list) != n or len(input_tensor_list) != n:
        raise ValueError(f"all_to_all needs {n} input and {n} output tensors, got {len(input_tensor_list)} and "
                         f"{len(output_tensor_list)}")
    if _uniform(list(input_tensor_list)) and _uniform(list(output_tensor_list)) \
            and input_tensor_list[0].shape == output_tensor_list[0].shape:
        def deliver(op: AllToAll) -> None:
            for out, t in zip(output_tensor_list, op.result, strict=True):
                out.copy_(t)
        return run(ctx, AllToAll(ctx.rank, chunks=torch.stack([t.detach() for t in input_tensor_list])), async_op,
                   deliver)
    return _exchange_chunks(ctx, [t.detach() for t in input_tensor_list], list(output_tensor_list), async_op)


def _exchange_chunks(ctx: WorkerContext, chunks: list[torch.Tensor], outputs: list[torch.Tensor],
                     async_op: bool) -> Work | None:
    """Chunks of different shapes: each rank's chunks travel as one pickle, and rank r keeps chunk r of each."""
    for j, (out, t) in enumerate(zip(outputs, chunks, strict=True)):
        if out.dtype != t.dtype:
            raise ValueError(f"all_to_all: output {j} is {out.dtype}, input {j} is {t.dtype}")

    def deliver(op: Exchange) -> None:
        for j, (out, blob) in enumerate(zip(outputs, op.result, strict=True)):
            got = loads(blob)[ctx.rank]
            if got.numel() != out.numel():
                raise ValueError(f"all_to_all: logical rank {j} sent {got.numel()} elements to rank {ctx.rank}, "
                                 f"whose output {j} holds {out.numel()}")
            out.copy_(got.reshape(out.shape))

    return run(ctx, Exchange(ctx.rank, what="all_to_all", payload=dumps([t.cpu() for t in chunks])), async_op,
               deliver)


@logical("all_to_all_single")
def _all_to_all_single(ctx: WorkerContext, output: torch.Tensor, input: torch.Tensor,
                       output_split_sizes: list[int] | None = None, input_split_sizes: list[int] | None = None,
                       group: Any = None, async_op: bool = False) -> Work | None:
    check_group(group, "all_to_all_single")
    n = ctx.world_size
    if input_split_sizes is None and output_split_sizes is None:
        if input.shape[0] % n or output.shape[0] % n or input.shape != output.shape:
            raise ValueError(f"all_to_all_single: without split sizes, input and output must have the same shape, "
                             f"with a first dimension divisible by {n}")
        chunks = input.detach().reshape(n, input.shape[0] // n, *input.shape[1:])

        def deliver(op: AllToAll) -> None:
            output.copy_(op.result.reshape(output.shape))
        return run(ctx, AllToAll(ctx.rank, chunks=chunks), async_op, deliver)
    ins = list(input_split_sizes) if input_split_sizes is not None else [input.shape[0] // n] * n
    outs = list(output_split_sizes) if output_split_sizes is not None else [output.shape[0] // n] * n
    if len(ins) != n or len(outs) != n or sum(ins) != input.shape[0] or sum(outs) != output.shape[0]:
        raise ValueError(f"all_to_all_single: split sizes must be {n} numbers adding up to the first dimension "
                         f"(input {tuple(input.shape)} by {ins}, output {tuple(output.shape)} by {outs})")
    return _exchange_chunks(ctx, list(input.detach().split(ins)), list(output.split(outs)), async_op)


@logical("monitored_barrier")
def _monitored_barrier(ctx: WorkerContext, group: Any = None, timeout: Any = None,
                       wait_all_ranks: bool = False) -> None:
    check_group(group, "monitored_barrier")
    ctx.barrier()


@logical("all_reduce_coalesced")
def _all_reduce_coalesced(ctx: WorkerContext, tensors: list[torch.Tensor], op: Any = dist.ReduceOp.SUM,
                          group: Any = None, async_op: bool = False) -> Work | None:
    check_group(group, "all_reduce_coalesced")
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    works = [ctx.all_reduce(t, op=op_name(op), async_op=True) for t in tensors]
    return works[-1] if async_op and works else _wait_all(works)


@logical("all_gather_coalesced")
def _all_gather_coalesced(ctx: WorkerContext, output_tensor_lists: list[list[torch.Tensor]],
                          input_tensor_list: list[torch.Tensor], group: Any = None,
                          async_op: bool = False) -> Work | None:
    check_group(group, "all_gather_coalesced")
    if len(output_tensor_lists) != ctx.world_size:
        raise ValueError(f"all_gather_coalesced needs {ctx.world_size} output lists")
    works = []
    for i, t in enumerate(input_tensor_list):
        def deliver(every: list[torch.Tensor], i: int = i) -> None:
            for r, got in enumerate(every):
                output_tensor_lists[r][i].copy_(got)
        works.append(gather_all(ctx, t, True, deliver))
    return works[-1] if async_op and works else _wait_all(works)


def _wait_all(works: list[Any]) -> None:
    for w in works:
        if w is not None:
            w.wait()
    return None
