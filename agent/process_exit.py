"""How an agent process ends: what interpreter shutdown does that a job can see, without the rest.

With torch and its compiler stack loaded, Python's finalisation frees some 300,000 objects module by
module and runs torch's static destructors: 0.5-1.2 s of CPU per agent, paid at the end of every run, of
every agent a shrink retires and of every spare, while the launcher or daemon waits for the exit code.
`finish` keeps what a job can observe of a normal exit, in the interpreter's order, then leaves at once:

1. the hooks registered through `threading._register_atexit` run, then threads the script started and did
   not mark daemon are joined (as `threading._shutdown`): the hooks are what tell a `ThreadPoolExecutor`'s
   idle workers (torch's compiler keeps one) to leave, so joining first would wait forever; elasticd's
   worker threads, which say they are not daemon so that the threads a worker starts are not daemon by
   inheritance (agent/runtime.py), are never waited for (one may be stuck in a collective of a failed run);
2. atexit handlers run: logging's flush, multiprocessing's reaping of daemonic children (DataLoader
   workers), and the script's own;
3. every Python file object still open is flushed, text layers before the buffers under them: what the
   garbage collection of a never-closed `open(...)` at module level would have written.

Not kept: `__del__` methods of other objects that only module teardown would have reached. Python does
not promise to call those at exit, and a library that must write at exit registers with atexit. Nor
torch's operator libraries' exit finalizers (`torch.library._del_library`, registered through
`weakref.finalize`, tens of milliseconds per process): they unregister operators from the process that is
leaving, which nothing outside it can see.

The open files are found by one pass over the garbage collector's objects (some 300,000 with torch
loaded), checked against the C base class of Python's files, not the `io.IOBase` ABC: the ABC check per
object took a third of a second of CPU per agent, more than a short run's training.
"""

from __future__ import annotations

import _io
import atexit
import gc
import io
import os
import sys
import threading
import traceback
import weakref
from collections.abc import Callable
from typing import NoReturn

_not_joined: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


def never_join(thread: threading.Thread) -> None:
    """`thread` is elasticd's own (a worker's): the exit does not wait for it."""
    _not_joined.add(thread)


def run(main: Callable[[], int | None]) -> NoReturn:
    """`finish(main())`, with what escapes `main` ended as the interpreter would end it: SystemExit's code,
    any other exception printed and 1. Never Python's own shutdown, which would wait for worker threads."""
    try:
        code = main()
    except SystemExit as e:
        code = _code_of(e.code)
    except BaseException:   # noqa: BLE001 - the interpreter's top level: print it, exit 1
        traceback.print_exc()
        code = 1
    finish(code)


def _code_of(arg: object) -> int:
    if arg is None:
        return 0
    if isinstance(arg, int):
        return arg
    print(arg, file=sys.stderr)
    return 1


def finish(code: int | None) -> NoReturn:
    """End this process with `code` (None: 0), as `sys.exit(code)` from the main thread would."""
    code = 0 if code is None else code
    try:
        _join_threads()
        _skip_torch_library_finalizers()
        atexit._run_exitfuncs()
        _flush_open_files()
    except BaseException:   # noqa: BLE001 - as the interpreter: report, and still exit with the code
        try:
            traceback.print_exc()
        except BaseException:   # noqa: BLE001, S110 - stderr itself is gone
            pass
    os._exit(code)


def _join_threads() -> None:
    # threading's own shutdown order: set the flag that refuses new thread-atexit hooks and new executor
    # work, run the hooks newest first, then join.
    threading._SHUTTING_DOWN = True   # type: ignore[attr-defined]
    for call in reversed(list(getattr(threading, "_threading_atexits", ()))):
        call()
    main = threading.main_thread()
    for t in threading.enumerate():
        if t is not main and not t.daemon and t is not threading.current_thread() and t not in _not_joined:
            t.join()


def _skip_torch_library_finalizers() -> None:
    torch_library = sys.modules.get("torch.library")
    unregister = getattr(torch_library, "_del_library", None)
    if unregister is None:
        return
    for fin in list(getattr(weakref.finalize, "_registry", ())):
        held = fin.peek()
        if held is not None and held[1] is unregister:
            fin.atexit = False


def _open_files() -> list[io.IOBase]:
    # Only instances of the C base `_io._IOBase` (every class of `io`, and any class deriving from one) flush
    # when collected, so only they have anything teardown would write; an ABC check (`io.IOBase`) per
    # object costs several times more. `_pyio`'s pure-Python files close in their own `__del__`, hence
    # checked too when that module is loaded.
    pyio = sys.modules.get("_pyio")
    kinds = (_io._IOBase, pyio.IOBase) if pyio is not None else _io._IOBase
    # type(), not isinstance(): isinstance consults __class__, which some module proxies answer with a
    # deprecation warning.
    return [o for o in gc.get_objects() if issubclass(type(o), kinds)]


def _flush_open_files() -> None:
    files = _open_files()
    files.sort(key=lambda f: 0 if isinstance(f, io.TextIOBase) else 1 if isinstance(f, io.BufferedIOBase) else 2)
    for f in [*files, sys.stdout, sys.stderr]:
        try:
            if f is not None and not f.closed and f.writable():
                f.flush()
        except (OSError, ValueError):
            pass   # a closed pipe or a detached layer: nothing left to write to
