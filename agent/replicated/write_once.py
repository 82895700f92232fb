"""Plain values worker code writes into shared objects are written once, as each DDP rank writes its own.

Every DDP rank has an optimizer and a model of its own and makes the same writes to them: `g["lr"] *= 0.7`
into the optimizer's `param_groups` after each epoch, `model.tau *= 0.99` annealing a temperature kept on
the model. Hosted workers share one optimizer and one model, so a write that reads what it overwrites was
made once per hosted worker: the learning rate fell 0.7 per hosted worker at each step (0.28 from DDP), the
temperature grew 1.2 per hosted worker (0.15), exit 0. The k-th write of a key by each worker
is one logical write, as the k-th call of a step is (agent/replicated/once.py): the first worker to make it
writes, the others' are dropped. Writes made inside what runs once per step (the optimizer's step, a
scheduler's) are made as they come. On modules, only numbers, booleans and strings set outside a forward
(not `training`, each worker's own: replicated/group.py; not tensors, nor what a forward stores for itself).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from elasticd.agent import patches
from elasticd.agent.worker import current_worker


class WriteCounts:
    """Which worker's write of a key is the one made: the first worker's k-th, for every k."""

    __slots__ = ("_writes", "_made")

    def __init__(self) -> None:
        self._writes: dict[tuple[int, Any], int] = {}   # (rank, key) -> writes that worker made
        self._made: dict[Any, int] = {}                  # key -> writes made to the shared object

    def made(self, rank: int, key: Any) -> bool:
        k = self._writes.get((rank, key), 0)
        self._writes[(rank, key)] = k + 1
        made = self._made.get(key, 0)
        if k < made:
            return False   # another hosted worker made this write already
        self._made[key] = made + 1
        return True


def _writer() -> Any:
    """The worker whose write is counted: worker code, not what runs once per step for all."""
    w = current_worker()
    return w if w is not None and w.ctx is not None and w.turn.once_running is None else None


class SharedGroup(dict):
    """One of the shared optimizer's param_groups, whose hyperparameter writes count per worker."""

    __slots__ = ("_counts",)

    def __init__(self, group: dict[str, Any]) -> None:
        super().__init__(group)
        self._counts = WriteCounts()

    def __setitem__(self, key: Any, value: Any) -> None:
        w = _writer()
        if w is not None and not self._counts.made(w.rank, key):
            return
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


_PLAIN = (int, float, bool, str)
_ORIGINAL_SETATTR = torch.nn.Module.__setattr__


_MODULE_CALLS = frozenset({torch.nn.Module._call_impl.__code__, torch.nn.Module._wrapped_call_impl.__code__})


def _in_a_forward() -> bool:
    """Inside a module's call: a forward's own store (a rotary cache's `self.seq_len_cached = T`), which
    this worker's pass reads next and whose value may be this pass's alone (its own sequence length)."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code in _MODULE_CALLS:
            return True
        f = f.f_back
    return False


def _module_setattr(self: torch.nn.Module, name: str, value: Any) -> None:
    if type(value) in _PLAIN and name != "training":
        w = _writer()
        if w is not None:
            state = w.runtime.replicated
            if (state.is_replicated_module(self) and not _in_a_forward()
                    and not state.attr_writes.made(w.rank, (id(self), name))):
                return
    _ORIGINAL_SETATTR(self, name, value)


_LEDGER = patches.ledger("replicated.write_once")


def install() -> None:
    """Count plain attribute writes to replicated modules in this process (idempotent)."""
    if not _LEDGER.active:
        _LEDGER.set(torch.nn.Module, "__setattr__", _module_setattr)

