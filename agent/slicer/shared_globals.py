"""An `@elastic` function that assigns module globals: one variable for every hosted worker of an agent.

Each DDP process has module globals of its own; here the hosted workers of an agent are threads of one
process sharing the script's module. `global accum_steps; accum_steps //= world_size`, what a script's
top level moved into a function needs in order to run again, then applies once per hosted worker to one
variable: a different result, exit 0. Found statically (the function's code and the functions defined in
it), before it runs. Module-level helpers it calls are not looked into. torchrun-mode scripts run as a
module of their own per worker, where their globals are per rank, and are not checked.
"""

from __future__ import annotations

import dis
import functools
from collections.abc import Callable
from types import CodeType
from typing import Any


class SharedGlobalError(RuntimeError):
    """The function assigns a module global, which the hosted workers of an agent would share."""


@functools.lru_cache(maxsize=64)
def _assigned(code: CodeType) -> frozenset[str]:
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL")}
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _assigned(const)
    return frozenset(names)


def refuse(fn: Callable[..., Any]) -> None:
    """Raise SharedGlobalError if the user's function (or one defined inside it) assigns a module global."""
    code = getattr(fn, "__code__", None)
    if code is None or getattr(fn, "__module__", "").startswith("elasticd."):
        return   # the agent's own stand-ins (torchrun mode's ScriptMain.fn)
    names = sorted(_assigned(code))
    if names:
        raise SharedGlobalError(
            f"{fn.__qualname__}() assigns the module global(s) {', '.join(names)}: the logical workers an agent hosts "
            f"are threads of one process and share the script's module, so each worker's assignment would change "
            f"it for all of them (a DDP process has globals of its own). Keep per-rank values in local variables "
            f"(e.g. `accum = gradient_accumulation_steps // ctx.world_size`)")
