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
            for dtype, params in by_dtype(g.params).items():
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
            for dtype, params in by_dtype(g.params).items():
                if env.deterministic:
                    flat = env.sum_over_ranks([o.stash[(g.index, dtype)] for o in ops])  # type: ignore[attr-defined]
                else:
                    flat = env.phys.all_reduce_(flatten_grads(params))
                flat[: -len(params)].div_(env.workers)
                unflatten_grads(flat, params)
            g.sync_buffers()
