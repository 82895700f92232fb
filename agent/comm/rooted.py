"""Rooted collectives over logical ranks: reduce, gather, scatter, and the all-to-all exchanges.

Each is built from the flushes of collectives.py, so local pre-combination and deterministic mode's fixed
summation order come with them: `reduce` is an all-reduce whose result only the destination keeps, `gather`
an all-gather only the destination keeps, `scatter` a broadcast of the source's chunks of which each rank
keeps its own, `all_to_all` an all-gather of every rank's chunks of which each rank keeps the ones meant for
it. The traffic is the all-* one (about N/2 times a true rooted op's); scripts use them for metrics, evaluation
and the occasional routing, where one code path that is right on every layout matters more than bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from elasticd.agent.comm.collectives import (
    AllGather,
    AllReduce,
    Collective,
    FlushEnv,
    _tensor_sig,
)


@dataclass(slots=True)
class Reduce(Collective):
    """`dst`'s tensor becomes the reduction over all ranks; the others keep theirs (as NCCL leaves them)."""

    op: ClassVar[str] = "reduce"
    tensor: torch.Tensor = None  # type: ignore[assignment]
    dst: int = 0
    reduce_op: str = "sum"

    def signature(self) -> tuple:
        return (self.op, self.dst, self.reduce_op, *_tensor_sig(self.tensor))

    @classmethod
    def flush(cls, ops: list[Collective], env: FlushEnv) -> None:
        copies = [AllReduce(o.rank, tensor=o.tensor.detach().clone(), reduce_op=o.reduce_op)  # type: ignore[attr-defined]
                  for o in ops]
        AllReduce.flush(copies, env)  # type: ignore[arg-type]
        for o, c in zip(ops, copies, strict=True):
            if o.rank == o.dst:  # type: ignore[attr-defined]
                o.tensor.copy_(c.tensor)  # type: ignore[attr-defined]


@dataclass(slots=True)
class GatherTo(Collective):
    """Every rank's tensor, in rank order, as `result` of the destination's op (None elsewhere)."""

    op: ClassVar[str] = "gather"
    tensor: torch.Tensor = None  # type: ignore[assignment]
    dst: int = 0

    def signature(self) -> tuple:
        return (self.op, self.dst, *_tensor_sig(self.tensor))

    @classmethod
    def flush(cls, ops: list[Collective], env: FlushEnv) -> None:
        every = env.gather_over_ranks([o.tensor for o in ops])  # type: ignore[attr-defined]
        for o in ops:
            o.result = [t.clone() for t in every] if o.rank == o.dst else None  # type: ignore[attr-defined]


@dataclass(slots=True)
class Scatter(Collective):
    """Rank r's `tensor` gets the source's r-th chunk; `chunks` is (N, *tensor.shape) on the source only."""

    op: ClassVar[str] = "scatter"
    tensor: torch.Tensor = None  # type: ignore[assignment]
    src: int = 0
    chunks: torch.Tensor | None = None

    def signature(self) -> tuple:
        return (self.op, self.src, *_tensor_sig(self.tensor))

    @classmethod
    def flush(cls, ops: list[Collective], env: FlushEnv) -> None:
        first: Scatter = ops[0]  # type: ignore[assignment]
        src = first.src
        local = {o.rank: o for o in ops}
        stack = (local[src].chunks.clone() if src in local  # type: ignore[attr-defined,union-attr]
                 else first.tensor.new_empty((env.workers, *first.tensor.shape)))
        env.phys.broadcast_(stack, env.owner(src))
        for o in ops:
            o.tensor.copy_(stack[o.rank])  # type: ignore[attr-defined]


@dataclass(slots=True)
class AllToAll(Collective):
    """Equal chunks: rank r's `chunks` is (N, ...) with row j meant for rank j; `result` is (N, ...) with
    row j from rank j. Unequal ones go through objects.Exchange."""

    op: ClassVar[str] = "all_to_all"
    chunks: torch.Tensor = None  # type: ignore[assignment]

    def signature(self) -> tuple:
        return (self.op, *_tensor_sig(self.chunks))

    @classmethod
    def flush(cls, ops: list[Collective], env: FlushEnv) -> None:
        gathered = [AllGather(o.rank, tensor=o.chunks) for o in ops]  # type: ignore[attr-defined]
        AllGather.flush(gathered, env)  # type: ignore[arg-type]
        every = gathered[0].result
        for o in ops:
            o.result = torch.stack([t[o.rank] for t in every])
