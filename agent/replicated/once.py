"""Operations that run once per physical step, however many hosted workers call them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from elasticd.agent.worker import current_worker


class OncePerStep:
    """Runs the k-th call of an operation once, however many hosted workers make their k-th call.

    Hosted workers run the same program, so their k-th calls are the same logical operation; the first
    one to arrive runs it and later ones get its result. Results are dropped once every hosted worker
    has fetched them.
    """

    def __init__(self, ranks: Iterable[int], what: str) -> None:
        self._ranks = tuple(ranks)
        self.what = what  # for errors: "the replicated optimizer's step()"
        self._calls = {r: 0 for r in self._ranks}
        self._results: dict[int, list[Any]] = {}  # call index -> [result, fetches left]
        self._executed = 0

    def call(self, rank: int, fn: Callable[[], Any]) -> Any:
        k = self._calls[rank]
        self._calls[rank] = k + 1
        if k == self._executed:
            self._executed += 1
            self._results[k] = [_sanctioned(rank, self.what, fn), len(self._ranks)]
        entry = self._results.get(k)
        if entry is None:  # the worker running it gave up its turn inside it; refused there, this is a backstop
            raise RuntimeError(f"elasticd: {self.what} is still running in another hosted worker: it waited "
                               f"inside an operation elasticd runs once per device for every worker there")
        entry[1] -= 1
        if entry[1] == 0:
            del self._results[k]
        return entry[0]


def _sanctioned(rank: int, what: str, fn: Callable[[], Any]) -> Any:
    """Run a once-per-step call as the runtime's own change of replicated state.

    What the calling worker changed before it is judged first (see `replicated/ledger.py`); what the call
    changes (parameters stepped, gradients cleared or clipped) is recorded as the new state afterwards.
    """
    w = current_worker()
    groups = w.runtime.groups if w is not None and w.ctx is not None else []
    for g in groups:
        g.ledger.check(rank)
    if w is not None:
        w.turn.once_running = what  # a collective inside it has one caller per device: refused (Runtime.enqueue)
    try:
        result = fn()
    finally:
        if w is not None:
            w.turn.once_running = None
    for g in groups:
        g.ledger.record()
    return result
