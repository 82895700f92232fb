"""The gradient flush: averaging replicated gradients over the N logical ranks at the end of backward."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

import torch

from elasticd.agent.comm.carried_vote import CARRIERS
from elasticd.agent.comm.collectives import Collective, FlushEnv
from elasticd.agent.replicated.flat import by_dtype, unflatten_grads

if TYPE_CHECKING:
    from elasticd.agent.replicated.group import ReplicatedGroup


def _room(env: FlushEnv, dtype: torch.dtype) -> int:
    """Deterministic mode: the zeros at the end of each rank's stash of `dtype`, where the flush may carry
    the step-boundary vote (comm/carried_vote.py)."""
    return env.vote.width if env.vote is not None and dtype in CARRIERS else 0


@dataclass(slots=True)
class GradSync(Collective):
    """The end of a backward pass: average the replicated gradients over all N logical ranks."""

    op: ClassVar[str] = "grad_sync"
    groups: list[ReplicatedGroup] = field(default_factory=list)
    # deterministic mode: this rank's own gradients, by (group index, dtype), summed over ranks at the flush
    stash: dict[tuple[int, torch.dtype], torch.Tensor] | None = None

    def on_arrive(self, env: FlushEnv) -> None:
        if not env.deterministic:
            return  # hosted gradients simply accumulate in the shared .grad
        # Keep each rank's gradient apart so the sum can follow the fixed rank tree (comm/rank_tree.py).
        self.stash = {}
        for g in self.groups:
            for dtype, flat in g.ledger.stash(self.rank, lambda dtype: _room(env, dtype)).items():
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
                    grads = [p.grad for p, k in zip(g.params, keep, strict=True) if p.grad is not None and not k]
                    if grads:   # one call, not one per parameter (a model of many small tensors paid ~4 us each)
                        torch._foreach_div_(grads, env.workers)
                    g.sync_buffers()
                    g.ledger.after_flush()
            return
        if not env.deterministic:
            # Persistent buckets, most of them already reduced while the last worker's backward ran; the
            # first fp32/fp64 one also carries the agents' step-boundary vote, so a step with a flush needs
            # no vote of its own (replicated/buckets.py, comm/carried_vote.py).
            env.grad_buckets.flush(first.groups)
            for g in first.groups:
                g.sync_buffers()
                g.ledger.after_flush()
            if env.vote is not None:
                env.vote.end_flush(env.phys.collectives)
            return
        # Deterministic mode sums each rank's own buffer along the rank tree. The first fp32/fp64 buffer
        # carries the vote: the first hosted rank's room holds the agent's ballot, every other rank's zeros.
        vote = env.vote
        for g in first.groups:
            for dtype, params in by_dtype(g.params).items():
                own = [o.stash[(g.index, dtype)] for o in ops]  # type: ignore[attr-defined]
                room = _room(env, dtype)
                ballot = vote.ballot(dtype, own[0].device) if room else None  # type: ignore[union-attr]
                if ballot is not None:
                    own[0][-room:].copy_(ballot)
                flat = env.sum_over_ranks(own)
                grads = flat[: flat.numel() - room]
                grads[: -len(params)].div_(env.workers)
                # The used-flags and the ballot sit together at the end of the buffer: one read for both.
                tail = flat[flat.numel() - room - len(params):].tolist()
                if ballot is not None:
                    vote.summed(tail[len(params):])  # type: ignore[union-attr]
                unflatten_grads(grads, params, tail[:len(params)])
            g.sync_buffers()
            g.ledger.after_flush()
        if vote is not None:
            vote.end_flush(env.phys.collectives)
