"""`os.environ` as each logical worker sees it: torchrun's per-process variables, per worker thread.

A torchrun script reads `os.environ["RANK"]`, `os.getenv("LOCAL_RANK")` or `dict(os.environ)`; under
torchrun every rank is a process with its own environment. Logical workers are threads of one process,
so `install()` replaces `os.environ` with a view that, in a worker thread, lays that worker's variables
over the process environment (`os.getenv` reads the `os.environ` global, so it follows). Outside worker
threads, and for every other key, it is the process environment, read and written through as before.

A worker writing one of its own variables (`os.environ["MASTER_PORT"] = ...`, as the mp.spawn tutorials
do) changes only its own view; any other write reaches the process, as it would under torchrun only for
that process: that is one of the process-global side effects a script may not rely on (README).
Subprocesses a worker starts with the inherited environment get its view (`subprocess.Popen` is given
`env=dict(os.environ)` in worker threads).
"""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Iterator
from typing import Any

from elasticd.agent import patches
from elasticd.agent.worker import current_worker
from elasticd.core.env_names import RESTARTS_VAR, torchrun_variables

_Environ = type(os.environ)
_GONE = None  # a worker deleted one of its own variables


def variables_for(rank: int, world: int) -> dict[str, str | None]:
    """Logical rank `rank`'s variables in this agent. MASTER_ADDR/PORT only matter to a script's
    `init_process_group`, which forms nothing here; an exported pair is passed on."""
    base = os.environ
    return dict(torchrun_variables(rank, world, base.get("MASTER_ADDR", "127.0.0.1"),
                                   int(base.get("MASTER_PORT", "29500")), int(base.get(RESTARTS_VAR, "0"))))


def _overlay() -> dict[str, str | None] | None:
    w = current_worker()
    return None if w is None else w.dist.env


class WorkerEnviron(_Environ):  # type: ignore[misc, valid-type]
    """The process environment (same storage, same putenv) with the calling worker's variables on top."""

    def __init__(self, base: Any) -> None:
        super().__init__(base._data, base.encodekey, base.decodekey, base.encodevalue, base.decodevalue)

    def __getitem__(self, key: str) -> str:
        ov = _overlay()
        if ov is not None and key in ov:
            value = ov[key]
            if value is _GONE:
                raise KeyError(key)
            return value
        return super().__getitem__(key)

    def __setitem__(self, key: str, value: str) -> None:
        ov = _overlay()
        if ov is not None and key in ov:
            self.encodevalue(value)  # the same TypeError as os.environ for a non-str
            ov[key] = value
            return
        super().__setitem__(key, value)

    def __delitem__(self, key: str) -> None:
        ov = _overlay()
        if ov is not None and key in ov:
            if ov[key] is _GONE:
                raise KeyError(key)
            ov[key] = _GONE
            return
        super().__delitem__(key)

    def __iter__(self) -> Iterator[str]:
        ov = _overlay()
        if ov is None:
            yield from super().__iter__()
            return
        for key in list(super().__iter__()):
            if key not in ov:
                yield key
        yield from (k for k, v in ov.items() if v is not _GONE)

    def __len__(self) -> int:
        ov = _overlay()
        return super().__len__() if ov is None else sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"environ({dict(self)!r})"

    def copy(self) -> dict[str, str]:
        return dict(self)


_LEDGER = patches.ledger("compat.worker_env")


def install() -> None:
    """Make `os.environ` the per-worker view (idempotent); names bound to the old object keep it."""
    if _LEDGER.active:
        return
    if not isinstance(os.environ, WorkerEnviron):
        _LEDGER.set(os, "environ", WorkerEnviron(os.environ))  # the same storage, viewed per worker
    original = subprocess.Popen.__init__

    @functools.wraps(original)
    def popen_init(self: Any, *args: Any, **kwargs: Any) -> None:
        # `env` is Popen's 11th parameter; a child started with the inherited environment gets the worker's view.
        if _overlay() is not None and kwargs.get("env") is None and len(args) < 11:
            kwargs["env"] = dict(os.environ)
        original(self, *args, **kwargs)

    _LEDGER.set(subprocess.Popen, "__init__", popen_init)
