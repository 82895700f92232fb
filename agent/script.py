"""Import a user's script and find its `@elastic` function."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

from elasticd.agent.decorator import ElasticFunction
from elasticd.agent.script_main import ScriptMain
from elasticd.core.errors import UsageError
from elasticd.core.script_source import is_torchrun_script


class ScriptError(UsageError):
    """The script cannot be imported, or holds no (or several) elastic functions."""


def load_target(script: str, func: str | None, args: list[str]) -> ElasticFunction | ScriptMain:
    """The script's `@elastic` function, or, for a script with none (and no FUNC named), its `__main__` to
    run once per logical worker, as torchrun would (agent/script_main.py).

    Raises:
        ScriptError: unreadable script, import error, or no unambiguous `@elastic` function.
    """
    path = _readable(script)
    if func is None and is_torchrun_script(path):
        return ScriptMain(path, args)
    sys.argv = [path, *args]  # as `python script.py ARGS` has them (not the agent's own command line)
    return load_function(script, func)


def import_script(script: str) -> ModuleType:
    """Import `script` as a module named after its file (`train.py` as `train`), not `__main__`, so that its
    `train()` footer does not fire. The name is what pickle records for the script's classes: a checkpoint
    holding a config dataclass loads wherever `import train` does (`__elasticd_script__` if another module
    already has the name).

    Raises:
        ScriptError: no such file, or not importable.
    """
    path = _readable(script)
    name = os.path.splitext(os.path.basename(path))[0]
    if name in sys.modules and getattr(sys.modules[name], "__file__", None) != path:
        name = "__elasticd_script__"
    script_dir = os.path.dirname(path)
    if script_dir not in sys.path:
        sys.path.insert(0, script_dir)  # the script's own imports work as under `python script.py`
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ScriptError(f"cannot import {script}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)  # errors in the user's module propagate with their traceback
    return module


def load_function(script: str, func: str | None) -> ElasticFunction:
    """Import `script` as a module (not `__main__`, so its `train()` footer does not fire).

    Raises:
        ScriptError: unreadable script, import error, or no unambiguous `@elastic` function.
    """
    module = import_script(script)
    if func:
        obj = getattr(module, func, None)
        if obj is None:
            raise ScriptError(f"{script} has no function {func!r}")
        if not isinstance(obj, ElasticFunction):
            raise ScriptError(f"{script}:{func} is not decorated with @elasticd.elastic(workers=N)")
        return obj
    found = [v for v in vars(module).values() if isinstance(v, ElasticFunction)]
    if not found:
        raise ScriptError(f"{script} has no function decorated with @elasticd.elastic(workers=N)")
    if len({id(f) for f in found}) > 1:
        names = ", ".join(sorted(f.fn.__name__ for f in found))
        raise ScriptError(f"{script} has several elastic functions ({names}); name one as SCRIPT:FUNC")
    return found[0]


def _readable(script: str) -> str:
    """The script's absolute path.

    Raises:
        ScriptError: it is not a file this process may read, saying which (a job may run as another user
            than the one who submitted it: elasticd/daemon/job_user.py).
    """
    path = os.path.abspath(script)
    try:
        with open(path, "rb"):
            pass
    except PermissionError:
        import pwd

        raise ScriptError(f"cannot read {script} as user {pwd.getpwuid(os.geteuid()).pw_name!r}, the user this job "
                          "runs as (Permission denied): make it and the directories above it readable by that "
                          "user") from None
    except OSError:
        raise ScriptError(f"no such script: {script}") from None
    if not os.path.isfile(path):
        raise ScriptError(f"no such script: {script}")
    return path
