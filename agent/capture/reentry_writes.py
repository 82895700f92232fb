"""Files a resumed function empties before its loop: said out loud, since DDP would have kept them.

After a resize or a recovery the function is re-entered, and the lines before `ctx.steps` run again.
Building the model again is what they are for; `open(log_file, "w")` (build-nanogpt truncates its log
there) empties a file the first run had been writing, and every line before the resize is gone, exit 0.
Nothing here can tell a log from a file meant to be rewritten, so the run goes on, but the job's output
says which file, at which step, and how to keep it (`if ctx.step == 0:`).

`builtins.open` and `io.open` (through which `pathlib.Path.open`, `write_text` and `write_bytes` go) are
wrapped only in an agent that resumes a function (never in a fresh run), and the check costs a
thread-local read per `open` call elsewhere. `os.open` with `O_TRUNC` is not seen.
"""

from __future__ import annotations

import builtins
import io
import logging
import os
import threading
from typing import Any

from elasticd.agent import patches
from elasticd.agent.worker import current_worker

log = logging.getLogger(__name__)

_real_open = builtins.open
_LEDGER = patches.ledger("capture.reentry_writes")
_warned: set[tuple[int, str]] = set()   # (logical rank's first resumed step, path): one line per file per resume
_lock = threading.Lock()


def _truncates(mode: Any) -> bool:
    return isinstance(mode, str) and "w" in mode


def _open(file: Any, mode: Any = "r", *args: Any, **kwargs: Any) -> Any:
    if _truncates(mode) and isinstance(file, (str, bytes, os.PathLike)):
        w = current_worker()
        if w is not None and w.progress.restore is not None and not w.capture.entered_steps:
            _warn(w.rank, w.progress.start_step, os.fsdecode(file), mode)
    return _real_open(file, mode, *args, **kwargs)


def _warn(rank: int, step: int, path: str, mode: str) -> None:
    try:
        if os.path.getsize(path) == 0:
            return   # nothing in it to lose
    except OSError:
        return       # not there yet: created, not emptied
    with _lock:
        key = (step, os.path.abspath(path))
        if key in _warned:
            return
        _warned.add(key)
    log.warning("logical rank %d opened %s with mode %r before ctx.steps, resuming at step %d: what the file "
                "held is gone (under DDP this line runs once). Guard it with `if ctx.step == 0:` to keep "
                "it.", rank, path, mode, step)


def watch() -> None:
    """Wrap `builtins.open` and `io.open` for this process (idempotent): called when an agent resumes a function."""
    _LEDGER.set(builtins, "open", _open)
    _LEDGER.set(io, "open", _open)
