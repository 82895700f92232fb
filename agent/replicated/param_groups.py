"""The replicated optimizer's `param_groups`: a hyperparameter written by worker code is written once.

Every DDP rank has an optimizer of its own and makes the same writes to it: `g["lr"] *= 0.7` after each
epoch, `g["lr"] = lr` from a hand-written schedule. Hosted workers share one optimizer, so a write that
reads what it overwrites was made once per hosted worker: the learning rate fell 0.7 per hosted worker at
each step, 0.28 from DDP, exit 0 (session 23). The k-th write of a key by each worker is one logical write,
as the k-th call of a step is (agent/replicated/once.py): the first worker to make it writes, the others'
are dropped. Writes made inside what runs once per step (the optimizer's step, a scheduler's) are made as
they come.
"""

from __future__ import annotations

from typing import Any

from elasticd.agent.worker import current_worker


class SharedGroup(dict):
    """One of the shared optimizer's param_groups, whose hyperparameter writes count per worker."""

    __slots__ = ("_writes", "_made")

    def __init__(self, group: dict[str, Any]) -> None:
        super().__init__(group)
        self._writes: dict[tuple[int, Any], int] = {}   # (rank, key) -> writes that worker made
        self._made: dict[Any, int] = {}                  # key -> writes made to the shared group

    def __setitem__(self, key: Any, value: Any) -> None:
        w = current_worker()
        if w is not None and w.ctx is not None and w.once_running is None:
            k = self._writes.get((w.rank, key), 0)
            self._writes[(w.rank, key)] = k + 1
            made = self._made.get(key, 0)
            if k < made:
                return   # another hosted worker made this write already
            self._made[key] = made + 1
        super().__setitem__(key, value)

    def __reduce__(self) -> Any:
        return dict, (dict(self),)   # pickled and deep-copied as the plain dict torch made


def shared_groups(optimizer: Any) -> list[dict[str, Any]]:
    """`optimizer.param_groups`, each a `SharedGroup` (made so in place, again after a `load_state_dict`)."""
    groups = optimizer.param_groups
    for i, g in enumerate(groups):
        if type(g) is not SharedGroup:
            groups[i] = SharedGroup(g)
    return groups
