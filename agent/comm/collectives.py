"""Collectives over logical ranks, buffered and flushed as one physical collective.

A worker that calls a collective records a pending op and gives up the baton. When every hosted worker
waits at the same collective, the agent calls the op class's `flush` with the ops in rank order: the
hosted contributions are pre-combined locally and one physical collective over the M agents finishes
the job. In deterministic mode sums follow a fixed tree over logical ranks (comm/rank_tree.py), so the
result does not depend on how ranks are spread over agents: each agent adds up the subtrees it hosts
whole, and only those cross the network (for big tensors shard by shard: an all-to-all brings each agent
every subtree's piece of its shard, then the summed shards are all-gathered).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from elasticd.agent.comm.carried_vote import CarriedVote
from elasticd.agent.comm.islands import Islands, two_level_sum
from elasticd.agent.comm.physical import PhysicalGroup
from elasticd.agent.comm.rank_tree import Node, pieces, tree_sum
from elasticd.core.errors import JobError
from elasticd.core.layout import Layout


class CollectiveMismatch(JobError, RuntimeError):
    """Two logical ranks called different collectives at the same point of the program."""


@dataclass(slots=True)
class FlushEnv:
    phys: PhysicalGroup
    workers: int
    deterministic: bool
    vote: CarriedVote | None = None   # the step-boundary vote a gradient flush may carry
    grad_buckets: Any = None          # default mode: the gradient flush's buckets (replicated/buckets.py)
    layout: Layout | None = None   # None: the uniform layout over phys.world
    # Agents per island (comm/islands.py): a deterministic sum goes in two levels, only the islands' own
    # pieces crossing between them (`two_level` False: flat, its traffic between islands counted, for
    # scripts/bench_islands.py). None, or one island: the flat sum.
    islands: Islands | None = None
    two_level: bool = True

    def counts(self) -> tuple[int, ...]:
        """How many logical ranks each agent hosts, in agent order."""
        if self.layout is None:
            self.layout = Layout.of(self.workers, self.phys.world)
        elif self.layout.world != self.phys.world or self.layout.workers != self.workers:
            raise ValueError(f"layout {self.layout} is not of {self.workers} workers on {self.phys.world} agents")
        return self.layout.sizes

    def owner(self, rank: int) -> int:
        self.counts()
        assert self.layout is not None
        return self.layout.owner(rank)

    def gather_over_ranks(self, hosted: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every logical rank's tensor, in rank order, from each agent's hosted tensors in rank order."""
        if self.phys.world == 1:
            return hosted
        return self._gather(hosted, self.counts())

    def _gather(self, tensors: list[torch.Tensor], counts: list[int] | tuple[int, ...]) -> list[torch.Tensor]:
        """Every agent's `tensors` (agent p passes counts[p] of one shape), in agent order: one all_gather."""
        stack = torch.stack(tensors)
        if stack.shape[0] < max(counts):  # uneven counts: all_gather wants equal shapes everywhere
            pad = stack.new_zeros((max(counts) - stack.shape[0], *stack.shape[1:]))
            stack = torch.cat([stack, pad])
        parts = self.phys.all_gather(stack)
        return [t for p, part in enumerate(parts) for t in part[: counts[p]]]

    def sum_over_ranks(self, hosted: list[torch.Tensor]) -> torch.Tensor:
        """The sum over all N logical ranks of their tensors (each agent passes its hosted ones)."""
        if self.deterministic:
            return self._sum_by_tree(hosted)
        total = hosted[0].clone()
        for t in hosted[1:]:
            total.add_(t)
        return self.phys.all_reduce_(total)

    def _pieces(self, agent: int) -> list[Node]:
        assert self.layout is not None
        lo = self.layout.starts[agent]
        return pieces(self.workers, lo, lo + self.layout.sizes[agent])

    def _shards(self, n: int) -> tuple[list[int], list[int]]:
        base, extra = divmod(n, self.phys.world)
        sizes = [base + (1 if j < extra else 0) for j in range(self.phys.world)]
        return sizes, [sum(sizes[:j]) for j in range(self.phys.world)]

    def _sum_by_tree(self, hosted: list[torch.Tensor]) -> torch.Tensor:
        """Deterministic sum: added up along the rank tree (comm/rank_tree.py), whose bits do not depend on
        the layout. Each agent sums its pieces (maximal subtrees of its block) and only those move. Big
        tensors are reduced shard by shard: agent j gets every agent's pieces of shard j (all-to-all), sums
        the tree's top over them, and the summed shards are all-gathered; small ones (below SHARD_MIN per
        agent) gather whole pieces, one collective instead of two."""
        phys, m, me = self.phys, self.phys.world, self.phys.rank
        self.counts()
        shape, n = hosted[0].shape, hosted[0].numel()
        lo, k = self.layout.starts[me], self.layout.sizes[me]  # type: ignore[union-attr]
        if len(hosted) != k:
            raise ValueError(f"agent {me} passed {len(hosted)} tensors to a sum over the {k} ranks it hosts")
        leaves = {(lo + i, lo + i + 1): t for i, t in enumerate(hosted)}
        mine = [tree_sum(leaves, p) for p in self._pieces(me)]
        if m == 1:
            return mine[0]
        split = self.islands is not None and len(self.islands.sizes) > 1
        if split and self.two_level:
            return two_level_sum(phys, self.layout, self.islands, mine)  # type: ignore[arg-type]
        everyone = [self._pieces(a) for a in range(m)]
        nodes = [node for p in everyone for node in p]   # agent after agent, each one's pieces in rank order
        item = hosted[0].element_size()
        if n < m * SHARD_MIN:
            if split:   # all_gather: every agent's (padded) pieces to every other agent
                self._count_cross([max(len(p) for p in everyone) * n * item] * m)
            got = self._gather(mine, [len(p) for p in everyone])
            return tree_sum(dict(zip(nodes, got, strict=True)), (0, self.workers))
        sizes, starts = self._shards(n)
        rows = [t.reshape(-1) for t in mine]
        # For each agent j: my pieces' parts of shard j, piece after piece (one piece: itself, no copy).
        send = rows[0] if len(rows) == 1 else torch.cat(
            [r[a:a + z] for a, z in zip(starts, sizes, strict=True) for r in rows])
        recv = send.new_empty(len(nodes) * sizes[me])
        if split:   # all_to_all: my pieces' parts of shard j to agent j; all_gather: my (padded) shard to all
            self._count_cross([len(rows) * z * item for z in sizes])
            self._count_cross([sizes[0] * item] * m)
        phys.all_to_all_(recv, send, [len(p) * sizes[me] for p in everyone], [len(rows) * z for z in sizes])
        shard = tree_sum(dict(zip(nodes, recv.view(len(nodes), sizes[me]), strict=True)), (0, self.workers))
        if sizes[me] < sizes[0]:  # all_gather wants equal sizes: the last shards may be one shorter
            shard = torch.cat([shard, shard.new_zeros(sizes[0] - sizes[me])])
        gathered = phys.all_gather(shard)
        return torch.cat([g[:z] for g, z in zip(gathered, sizes, strict=True)]).view(shape)


    def _count_cross(self, bytes_to: list[int]) -> None:
        """Count what this agent sends to agents of other islands (`bytes_to[j]`: to agent j)."""
        islands, me, phys = self.islands, self.phys.rank, self.phys
        assert islands is not None
        mine = islands.of(me)
        for j, b in enumerate(bytes_to):
            if b and islands.of(j) != mine:
                phys.cross_island_bytes += b
                phys.cross_island_messages += 1


# Below this many elements per agent a deterministic sum gathers whole tensors: one collective instead of
# two matters more than bytes for small tensors (losses, metrics, the step-boundary vote).
SHARD_MIN = 4096


@dataclass(slots=True)
class Collective:
    """Base of every logical collective; subclasses set `op` and implement `flush`."""

    op: ClassVar[str] = "collective"
    rank: int
    result: Any = field(default=None, init=False)

    def signature(self) -> tuple:
        return (self.op,)

    def on_arrive(self, env: FlushEnv) -> None:
        """Runs in the worker's thread when it queues the op, before any other worker runs."""

    @classmethod
    def flush(cls, ops: list[Collective], env: FlushEnv) -> None:
        raise NotImplementedError


def _tensor_sig(t: torch.Tensor) -> tuple:
    return (tuple(t.shape), str(t.dtype), t.device.type)


_REDUCE_OPS = ("sum", "avg", "max", "min", "product")


@dataclass(slots=True)
class AllReduce(Collective):
    op: ClassVar[str] = "all_reduce"
    tensor: torch.Tensor = None  # type: ignore[assignment]
    reduce_op: str = "sum"

    def signature(self) -> tuple:
        return (self.op, self.reduce_op, *_tensor_sig(self.tensor))

    @classmethod
    def flush(cls, ops: list[Collective], env: FlushEnv) -> None:
        first: AllReduce = ops[0]  # type: ignore[assignment]
        tensors = [o.tensor for o in ops]  # type: ignore[attr-defined]
        rop = first.reduce_op
        if rop in ("sum", "avg"):
            out = env.sum_over_ranks(tensors)
            if rop == "avg":
                out = out / env.workers if not out.is_floating_point() else out.div_(env.workers)
        elif rop == "product" and env.deterministic:
            every = env.gather_over_ranks(tensors)
            out = every[0].clone()
            for t in every[1:]:
                out.mul_(t)
        else:
            out = tensors[0].clone()
            for t in tensors[1:]:
                {"max": torch.maximum, "min": torch.minimum, "product": torch.mul}[rop](out, t, out=out)
            env.phys.all_reduce_(out, rop)
        for t in tensors:
            t.copy_(out)


@dataclass(slots=True)
class Broadcast(Collective):
    op: ClassVar[str] = "broadcast"
    tensor: torch.Tensor = None  # type: ignore[assignment]
    src: int = 0

    def signature(self) -> tuple:
        return (self.op, self.src, *_tensor_sig(self.tensor))

    @classmethod
    def flush(cls, ops: list[Collective], env: FlushEnv) -> None:
        src = ops[0].src  # type: ignore[attr-defined]
        local = {o.rank: o.tensor for o in ops}  # type: ignore[attr-defined]
        buf = local[src].clone() if src in local else torch.empty_like(ops[0].tensor)  # type: ignore[attr-defined]
        env.phys.broadcast_(buf, env.owner(src))
        for r, t in local.items():
            if r != src:
                t.copy_(buf)


@dataclass(slots=True)
class AllGather(Collective):
    op: ClassVar[str] = "all_gather"
    tensor: torch.Tensor = None  # type: ignore[assignment]

    def signature(self) -> tuple:
        return (self.op, *_tensor_sig(self.tensor))

    @classmethod
    def flush(cls, ops: list[Collective], env: FlushEnv) -> None:
        every = env.gather_over_ranks([o.tensor for o in ops])  # type: ignore[attr-defined]
        for o in ops:
            o.result = [t.clone() for t in every]


@dataclass(slots=True)
class ReduceScatter(Collective):
    """Rank r's `output` becomes the reduction over all ranks of their r-th input chunk."""

    op: ClassVar[str] = "reduce_scatter"
    output: torch.Tensor = None  # type: ignore[assignment]
    inputs: torch.Tensor = None  # type: ignore[assignment]  # (N, *output.shape): the rank's own copy
    reduce_op: str = "sum"

    def signature(self) -> tuple:
        return (self.op, self.reduce_op, tuple(self.inputs.shape), *_tensor_sig(self.output))

    @classmethod
    def flush(cls, ops: list[Collective], env: FlushEnv) -> None:
        # Reduce the whole (N, ...) stacks with AllReduce's flush (local pre-sum, deterministic order and
        # all), then each rank keeps its row: about twice the traffic of a true reduce-scatter (an
        # all-reduce is a reduce-scatter plus an all-gather), but one code path for every mode.
        stacks = [AllReduce(o.rank, tensor=o.inputs, reduce_op=o.reduce_op) for o in ops]  # type: ignore[attr-defined]
        AllReduce.flush(stacks, env)
        for o in ops:
            o.output.copy_(o.inputs[o.rank])  # type: ignore[attr-defined]


@dataclass(slots=True)
class Barrier(Collective):
    op: ClassVar[str] = "barrier"

    @classmethod
    def flush(cls, ops: list[Collective], env: FlushEnv) -> None:
        env.phys.barrier()


def check_matching(ops: list[Collective]) -> None:
    """Raise CollectiveMismatch naming two ranks whose collectives differ (else the job would hang)."""
    first = ops[0]
    for o in ops[1:]:
        if o.signature() != first.signature():
            raise CollectiveMismatch(
                f"logical ranks {first.rank} and {o.rank} called different collectives at the same point: "
                f"rank {first.rank}: {first.signature()}, rank {o.rank}: {o.signature()}"
            )


def validate_reduce_op(op: str) -> str:
    if op not in _REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}; expected one of {', '.join(_REDUCE_OPS)}")
    return op
