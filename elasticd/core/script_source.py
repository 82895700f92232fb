"""What a job script declares, read from its source without running it (the CLI needs it before any agent starts)."""

from __future__ import annotations

import ast


def is_torchrun_script(path: str) -> bool:
    """True if the script never calls an `elastic(...)` decorator: it is run the way torchrun runs it.

    Decided from the source, without running it: importing a torchrun script as a module would execute
    its top level once more than torchrun does.

    Raises:
        SyntaxError: the script does not parse (the user's error, with its line).
    """
    return not any(isinstance(node, ast.Call) and _called_name(node) == "elastic" for node in ast.walk(_parse(path)))


def _parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as f:
        return ast.parse(f.read(), filename=path)


def _called_name(call: ast.Call) -> str | None:
    """`elastic` for `elastic(...)` and `elasticd.elastic(...)` alike."""
    target = call.func
    return target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)


def declared_workers(path: str, func: str | None) -> int | None:
    """N as the script's decorator spells it (`@elasticd.elastic(workers=8)`, a literal), read from the source.

    The CLI needs N before any agent starts; importing the script for it would run its top level in the
    CLI's process, once more than the run does. None when the source does not say (N computed, several
    decorated functions and no FUNC): the caller then imports it.
    """
    found: list[int | None] = []
    for node in ast.walk(_parse(path)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or (func and node.name != func):
            continue
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and _called_name(deco) == "elastic"):
                continue
            args = [k.value for k in deco.keywords if k.arg == "workers"] + deco.args[:1]
            value = args[0] if args else None
            ok = isinstance(value, ast.Constant) and type(value.value) is int
            found.append(value.value if ok else None)
    return found[0] if len(found) == 1 else None
