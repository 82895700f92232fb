"""`sys.modules["__main__"]` as each torchrun-mode worker's own script.

Under torchrun every rank's `__main__` is the script, so pickle saves an object of a class the script
defines by reference, `__main__.GPTConfig`, and finds the class again by that name (karpathy's
build-nanogpt saves its config dataclass in every checkpoint; a `torch.save` of a whole model does the
same). In torchrun mode each worker runs the script in a module of its own (agent/script_main.py), so
the class is not an attribute of the agent's `__main__`, and pickling it failed.

The agent's `__main__` module therefore answers, in a worker's thread, with that worker's module: every
attribute read, write and delete, `__file__` and `__dict__` included, as `sys.modules["__main__"]` is
the script in a torchrun process. Other threads (the agent's own, or threads a script starts) see the
agent's `__main__` as before. Globals the script's own code reads are untouched: its functions look
them up in their module's dict, not through `sys.modules`.
"""

from __future__ import annotations

import sys
import types
from typing import Any

from elasticd.agent import patches
from elasticd.agent.worker import current_worker

_LEDGER = patches.ledger("compat.per_rank_main")


def _own() -> types.ModuleType | None:
    w = current_worker()
    return None if w is None else w.dist.main_module


class _PerWorkerMain(types.ModuleType):
    def __getattribute__(self, name: str) -> Any:
        own = _own()
        return super().__getattribute__(name) if own is None else getattr(own, name)

    def __setattr__(self, name: str, value: Any) -> None:
        own = _own()
        if own is None:
            super().__setattr__(name, value)
        else:
            setattr(own, name, value)

    def __delattr__(self, name: str) -> None:
        own = _own()
        if own is None:
            super().__delattr__(name)
        else:
            delattr(own, name)


def install() -> None:
    """Make the agent's `__main__` answer for the calling worker's script (idempotent)."""
    main = sys.modules.get("__main__")
    if isinstance(main, _PerWorkerMain):
        return
    if type(main) is types.ModuleType:
        _LEDGER.set(main, "__class__", _PerWorkerMain)   # the same object: its holders see the workers' modules
    else:   # no `__main__`, or one of a class of its own: a stand-in, which outside workers has nothing
        _LEDGER.set_item(sys.modules, "__main__", _PerWorkerMain("__main__"))
