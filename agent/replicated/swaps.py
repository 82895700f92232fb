"""Values a worker sets into a replicated parameter through `.data` are its own until it sets them back.

`with ema.average_parameters(): evaluate()` (torch_ema; the same by hand with `p.data.copy_`) swaps each
DDP rank's EMA weights into its own model and back. Hosted workers share one model: when the evaluation
made a collective (its metric all-reduced), the next worker ran with the first one's EMA weights in place,
took them for its training weights and restored those at the end; 0.49 from DDP, exit 0.
A worker that leaves the device (a hand-over) with a parameter it set through `.data` still changed keeps
those values as its own and the parameter gets back what it held before; they come back when the worker
runs again, until it sets the parameter back. The optimizer's step (run once, for every hosted worker)
makes what it finds the parameter's value for all of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from elasticd.agent.worker import Worker


class _Swap:
    __slots__ = ("param", "base", "own")

    def __init__(self, param: torch.Tensor) -> None:
        self.param = param
        self.base = param.detach().clone()     # the shared value when this worker first set it
        self.own: torch.Tensor | None = None   # this worker's values while another worker runs


class ParamSwaps:
    def __init__(self) -> None:
        self._by_rank: dict[int, dict[int, _Swap]] = {}

    def before_set(self, rank: int, param: torch.Tensor) -> None:
        """A worker is about to set values into `param` through `.data`."""
        swaps = self._by_rank.setdefault(rank, {})
        if id(param) not in swaps:
            swaps[id(param)] = _Swap(param)

    def on_switch(self, outgoing: Worker | None, incoming: Worker) -> None:
        if outgoing is not None:
            swaps = self._by_rank.get(outgoing.rank)
            if swaps:
                with torch.no_grad():
                    for key, s in list(swaps.items()):
                        live = _alias(s.param)
                        if torch.equal(live, s.base):
                            del swaps[key]     # set back: nothing of its own left
                        else:
                            s.own = live.clone()
                            live.copy_(s.base)
        swaps = self._by_rank.get(incoming.rank)
        if swaps:
            with torch.no_grad():
                for s in swaps.values():
                    if s.own is not None:
                        live = _alias(s.param)
                        s.base.copy_(live)     # the shared value may have moved on meanwhile
                        live.copy_(s.own)
                        s.own = None

    def commit(self, rank: int) -> None:
        """The optimizer is about to step, once for every hosted worker, in worker `rank`: what that worker
        set is the parameters' value now, and so for another worker that set the same values (an EMA copied
        in for good by all); another worker's values of its own (its EMA swapped in across a collective)
        stay its own."""
        mine = self._by_rank.pop(rank, {})
        if not mine:
            return
        for other in self._by_rank.values():
            for key in [k for k, s in other.items() if k in mine and s.own is not None
                        and torch.equal(s.own, _alias(s.param))]:
                del other[key]


def _alias(param: torch.Tensor) -> torch.Tensor:
    """The parameter's memory with a version counter of its own, as `.data` gives it: these writes are the
    runtime's, which the ledger must not take for the worker's (agent/replicated/ledger.py)."""
    return torch._C.TensorBase.data.__get__(param)

