"""`@elasticd.elastic(workers=N)`: marks the training function and runs it standalone when called."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

from elasticd.agent.standalone import run_standalone


class ElasticFunction:
    """A training function written for `workers` data-parallel workers.

    Calling it with no arguments (`python script.py` ending in `train()`) runs all N logical workers on
    this machine's devices. The agent and the reference runner call `.fn` with a context instead.
    """

    def __init__(self, fn: Callable[[Any], Any], workers: int, deterministic: bool) -> None:
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"@elastic(workers=...) must be a positive integer, got {workers!r}")
        self.fn = fn
        self.workers = workers
        self.deterministic = bool(deterministic)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args or kwargs:
            raise TypeError(f"{self.fn.__name__}() takes no arguments when called directly: elasticd calls it "
                            f"with ctx alone, once per logical worker, also under `elasticd run` and submit. "
                            f"Take the rank and world size from ctx (ctx.rank, ctx.world_size) and other values "
                            f"from the script's arguments (sys.argv) or its module level")
        return run_standalone(self)

    def __repr__(self) -> str:
        return f"<elastic {self.fn.__module__}.{self.fn.__qualname__} workers={self.workers}>"

    @property
    def script_path(self) -> str | None:
        module = sys.modules.get(self.fn.__module__)
        return getattr(module, "__file__", None)


def elastic(workers: int, deterministic: bool = False) -> Callable[[Callable[[Any], Any]], ElasticFunction]:
    """Declare a data-parallel training function for `workers` logical workers.

    `deterministic=True` fixes the gradient reduction order over logical ranks, so results are bitwise
    identical for any number of devices (at some cost: see the README).
    """

    def wrap(fn: Callable[[Any], Any]) -> ElasticFunction:
        return ElasticFunction(fn, workers, deterministic)

    return wrap
