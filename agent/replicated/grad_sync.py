"""The gradient flush: averaging replicated gradients over the N logical ranks at the end of backward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from elasticd.agent.comm.collectives import Collective, FlushEnv
from elasticd.agent.replicated.flat import by_dtype, flatten_grads, unflatten_grads

if TYPE_CHECKING:
    from elasticd.agent.replicated.group import ReplicatedGroup


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
            for dtype, flat in g.ledger.stash(self.rank).items():
                self.stash[(g.index, dtype)] = flat

    @classmethod
    def flush(cls, ops: list[Collective], env: FlushEnv) -> None:
        first: GradSync = ops[0]  # type: ignore[assignment]
        last = ops[-1].rank  # the flush runs in the last arriving worker's thread, after its changes
        local_only = env.phys.world == 1 and not env.deterministic
        untouched = [g.ledger.before_flush(last, local_only) for g in first.groups]
        if local_only:
            # One agent: the shared .grad already holds the sum over every rank, and a missing grad
            # already means no rank produced one. Averaging is all that is left; no flat copy needed.
            # A gradient still holding the last flush's average (no rank accumulated since) keeps it.
            with torch.no_grad():
                for g, keep in zip(first.groups, untouched, strict=True):
                    for p, k in zip(g.params, keep, strict=True):
                        if p.grad is not None and not k:
                            p.grad.div_(env.workers)
                    g.ledger.after_flush()
            return
        # Default mode: the first fp32/fp64 buffer also carries the agents' step-boundary vote, so a step
        # with a flush needs no vote of its own (comm/carried_vote.py). Deterministic mode sums each
        # rank's own buffer: appending there would copy every one, so it votes apart as before.
        vote = env.vote if not env.deterministic else None
        for g in first.groups:
            for dtype, params in by_dtype(g.params).items():
                if env.deterministic:
                    flat = env.sum_over_ranks([o.stash[(g.index, dtype)] for o in ops])  # type: ignore[attr-defined]
                else:
                    ballot = vote.ballot(dtype, params[0].device) if vote is not None else None
                    flat = env.phys.all_reduce_(flatten_grads(params, ballot))
                    if ballot is not None:
                        assert vote is not None
                        vote.summed(flat[-ballot.numel():])
                        flat = flat[:-ballot.numel()]
                flat[: -len(params)].div_(env.workers)
                unflatten_grads(flat, params)
            g.sync_buffers()
            g.ledger.after_flush()
        if vote is not None:
            vote.end_flush(env.phys.collectives)
