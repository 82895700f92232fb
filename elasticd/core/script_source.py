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
    """N as the script's decorator spells it, read from the source: a literal (`@elasticd.elastic(workers=8)`),
    or a module-level name the script binds once, to a literal, before the decorator (`N = 8` ...
    `@elasticd.elastic(workers=N)`).

    The CLI needs N before any agent starts; importing the script for it would run its top level in the
    CLI's process, once more than the run does. None when the source does not say (N computed, a name bound
    more than once or anywhere but at the top level, several decorated functions and no FUNC): the caller
    then imports it.
    """
    tree = _parse(path)
    found: list[int | None] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or (func and node.name != func):
            continue
        for deco in node.decorator_list:
            if not (isinstance(deco, ast.Call) and _called_name(deco) == "elastic"):
                continue
            args = [k.value for k in deco.keywords if k.arg == "workers"] + deco.args[:1]
            found.append(_int_value(tree, args[0], node.lineno) if args else None)
    return found[0] if len(found) == 1 else None


def _int_value(tree: ast.Module, value: ast.expr, before: int) -> int | None:
    """The int `value` is when the decorator on line `before` runs: a literal, or a name bound exactly once
    in the whole script, by a top-level `NAME = <int literal>` above that line; else None."""
    if not isinstance(value, ast.Name):
        return _literal_int(value)
    # `from m import *` may bind it too, unseen here
    if sum(1 for node in ast.walk(tree) if value.id in _bound(node) or "*" in _bound(node)) != 1:
        return None
    for stmt in tree.body:
        if (isinstance(stmt, ast.Assign) and stmt.lineno < before and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name) and stmt.targets[0].id == value.id):
            return _literal_int(stmt.value)
    return None


def _literal_int(value: ast.expr) -> int | None:
    return value.value if isinstance(value, ast.Constant) and type(value.value) is int else None


def _bound(node: ast.AST) -> set[str]:
    """The names `node` binds or declares as another scope's (`global`, `nonlocal`)."""
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store | ast.Del):
        return {node.id}
    if isinstance(node, ast.alias):
        return {node.asname or node.name.split(".")[0]}
    if isinstance(node, ast.Global | ast.Nonlocal):
        return set(node.names)
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return {node.name}
    if isinstance(node, ast.arg):
        return {node.arg}
    if isinstance(node, ast.ExceptHandler | ast.MatchAs | ast.MatchStar) and node.name:
        return {node.name}
    return set()


def _elastic_names(tree: ast.Module) -> set[str]:
    """Module-level names of the script's @elastic functions: decorated ones, and `f = elastic(...)(g)`."""
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and any(
                isinstance(d, ast.Call) and _called_name(d) == "elastic" for d in node.decorator_list):
            names.add(node.name)
        elif (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
              and isinstance(node.value.func, ast.Call) and _called_name(node.value.func) == "elastic"):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _is_main_guard(node: ast.stmt) -> bool:
    """`if __name__ == "__main__":` (either way round)."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare) or len(node.test.comparators) != 1:
        return False
    sides = [node.test.left, node.test.comparators[0]]
    return (isinstance(node.test.ops[0], ast.Eq) and any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def _calls(node: ast.AST) -> set[str]:
    return {c.func.id for c in ast.walk(node) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}


def _only_runs(stmt: ast.stmt, elastic: set[str]) -> bool:
    """`train()`, `sys.exit(train())`, `exit(train())` or `pass`: a statement that does nothing but run it."""
    if isinstance(stmt, ast.Pass):
        return True
    if not isinstance(stmt, ast.Expr) or not isinstance(stmt.value, ast.Call):
        return False
    call = stmt.value
    if isinstance(call.func, ast.Name) and call.func.id in elastic:
        return not call.args and not call.keywords
    if _called_name(call) == "exit" and len(call.args) == 1 and isinstance(call.args[0], ast.Call):
        inner = call.args[0]
        return isinstance(inner.func, ast.Name) and inner.func.id in elastic and not inner.args and not inner.keywords
    return False


# Calls that set process-wide state a job's result depends on (`torch.manual_seed`, `np.random.seed`,
# lightning's `seed_everything`, transformers' `set_seed`: anything named like a seed, and these).
_STATEFUL = frozenset({"set_default_dtype", "set_default_device", "set_default_tensor_type",
                       "set_float32_matmul_precision", "use_deterministic_algorithms", "set_num_threads",
                       "set_flush_denormal", "set_grad_enabled"})


def _dotted(node: ast.expr) -> list[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return parts[::-1]


def changes_the_result(stmt: ast.stmt, helpers: set[str]) -> bool:
    """Whether a skipped statement can change what the job computes: a seed or another process-wide torch
    setting, a write to `os.environ` or to an attribute of `torch`, or a call of the script's own functions
    (what they do is not read here). A print, or a value computed and left unused, cannot."""
    for node in ast.walk(stmt):
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name and ("seed" in name[-1].lower() or name[-1] in _STATEFUL or name[0] in helpers):
                return True
        targets = (node.targets if isinstance(node, ast.Assign) else
                   [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else [])
        for t in targets:
            root = _dotted(t.value if isinstance(t, ast.Subscript) else t)
            if isinstance(t, ast.Attribute | ast.Subscript) and root[:1] in (["torch"], ["os"]):
                return True
    return False


def skipped_main_code(path: str) -> list[tuple[int, str, bool]]:
    """What `elasticd run SCRIPT` would silently skip: the script is imported, not run as `__main__`, and the
    runtime calls the @elastic function itself, so its `if __name__ == "__main__":` block never runs. That
    is harmless where the block only calls the function; anything else there (a `torch.manual_seed`, a
    `main()` that sets up and then calls it) would not happen, and the job would compute something else
    than `python SCRIPT` or torchrun does. Returns (line, first line of source, whether it can change the
    result: `changes_the_result`) of each such statement of a block that runs an @elastic function, directly
    or through a module-level function that calls one; [] for a script whose block does not (it is not how
    the script runs its job).

    Raises:
        SyntaxError: the script does not parse.
    """
    with open(path, encoding="utf-8") as f:
        source = f.read()
    tree = ast.parse(source, filename=path)
    elastic = _elastic_names(tree)
    helpers = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    lines = source.splitlines()
    out: list[tuple[int, str, bool]] = []
    for guard in (n for n in tree.body if _is_main_guard(n)):
        assert isinstance(guard, ast.If)
        called = _calls(guard)
        via = {name for name in called & set(helpers) if _calls(helpers[name]) & elastic and name not in elastic}
        if not called & elastic and not via:
            continue
        runs = elastic | via
        out += [(stmt.lineno, lines[stmt.lineno - 1].strip(), changes_the_result(stmt, set(helpers)))
                for stmt in _extras(guard.body, elastic, runs)]
    return out


def _extras(stmts: list[ast.stmt], elastic: set[str], runs: set[str]) -> list[ast.stmt]:
    """The statements of a `__main__` block other than running the job. An `if` whose branch runs it is
    looked into (`if IDEAL: plain_loop() else: train()`: the other branch is another way to run the
    script, not code the job needs), any other statement is listed."""
    out: list[ast.stmt] = []
    for stmt in stmts:
        if _only_runs(stmt, elastic):
            continue
        if isinstance(stmt, ast.If):
            running = [b for b in (stmt.body, stmt.orelse) if any(_calls(x) & runs for x in b)]
            if running:
                for branch in running:
                    out += _extras(branch, elastic, runs)
                continue
        out.append(stmt)
    return out
