"""An `@elastic` function that assigns module globals: one variable for every hosted worker of an agent.

Each DDP process has module globals of its own; here the hosted workers of an agent are threads of one
process sharing the script's module. `global accum_steps; accum_steps //= world_size`, what a script's
top level moved into a function needs in order to run again, then applies once per hosted worker to one
variable: a different result, exit 0. The same holds for an object a global names that the function
changes in place: `args.lr *= 0.5` or `stats["seen"] += n` (an augmented assignment into an attribute or
item of a global, anything but a module), `history.append(loss)` (a mutating method of a global list,
dict, set or deque). Found statically (the function's code and the functions defined in it; the in-place
changes from its source), before it runs. Module-level helpers it calls are not looked into. torchrun-mode
scripts run as a module of their own per worker, where their globals are per rank, and are not checked.
"""

from __future__ import annotations

import ast
import collections
import dis
import functools
import inspect
import textwrap
from collections.abc import Callable
from types import CodeType, ModuleType
from typing import Any

from elasticd.core.errors import JobError

_CONTAINERS = (list, dict, set, collections.deque, collections.OrderedDict, collections.defaultdict,
               collections.Counter)
_MUTATORS = frozenset({"append", "extend", "insert", "pop", "popleft", "appendleft", "extendleft", "remove",
                       "clear", "update", "setdefault", "popitem", "add", "discard", "sort", "reverse", "rotate"})


class SharedGlobalError(JobError, RuntimeError):
    """The function assigns a module global, which the hosted workers of an agent would share."""


@functools.lru_cache(maxsize=64)
def _assigned(code: CodeType) -> frozenset[str]:
    names = {ins.argval for ins in dis.get_instructions(code) if ins.opname in ("STORE_GLOBAL", "DELETE_GLOBAL")}
    for const in code.co_consts:
        if isinstance(const, CodeType):
            names |= _assigned(const)
    return frozenset(names)


def _root(node: ast.expr) -> str | None:
    """`a` for `a`, `a.b.c`, `a[k].b`: the variable an attribute or item chain starts from."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


@functools.lru_cache(maxsize=64)
def _changed_in_place(fn: Callable[..., Any]) -> list[str]:
    """Module globals whose objects the function's source changes in place (see the module docstring)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return []   # no source to read (made by exec, or a notebook cell gone): only the bytecode check applies
    local = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, (ast.Store, ast.Del))}
    local |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
              for a in [*n.posonlyargs, *n.args, *n.kwonlyargs, n.vararg, n.kwarg] if a is not None}
    local |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    local |= {(a.asname or a.name).split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
              for a in n.names}
    names = set()
    g = getattr(fn, "__globals__", {})
    for n in ast.walk(tree):
        name, containers_only = None, False
        if isinstance(n, ast.AugAssign) and isinstance(n.target, (ast.Attribute, ast.Subscript)):
            name = _root(n.target)
        elif (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in _MUTATORS
              and isinstance(n.func.value, ast.Name)):
            name, containers_only = n.func.value.id, True
        if name is None or name in local or name not in g or isinstance(g[name], ModuleType):
            continue
        if not containers_only or isinstance(g[name], _CONTAINERS):
            names.add(name)
    return sorted(names)   # (each worker asks: read and parsed once per function)


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
    changed = _changed_in_place(fn)
    if changed:
        raise SharedGlobalError(
            f"{fn.__qualname__}() changes the object(s) the module global(s) {', '.join(changed)} name in place "
            f"(`args.lr *= ...`, `history.append(...)`): the logical workers an agent hosts are threads of one "
            f"process and share the script's module, so each worker's change would apply to all of them (a DDP "
            f"process has globals of its own). Make the function its own copy first (`args = copy.copy(args)`, "
            f"`history = []`) and change that")
