"""Notes added to a worker's exception where a port from a torchrun script is the likely cause.

Top-level code moved into an `@elastic` function changes meaning where it assigns a module-level name:
the assignment makes the name local to the whole function, so a read before it raises a bare
`UnboundLocalError` although the module defines the name (nanoGPT's `device = ...` config, reassigned
to the rank's device further down). The note says which global is shadowed and what to do.
"""

from __future__ import annotations

import re
import types

_LOCAL = re.compile(r"local variable '([^']+)'")


def _innermost(tb: types.TracebackType | None) -> types.FrameType | None:
    frame = None
    while tb is not None:
        frame, tb = tb.tb_frame, tb.tb_next
    return frame


def add_hint(e: BaseException) -> None:
    """Add a note to `e` when a port of top-level code is its likely cause; otherwise leave it alone."""
    if not isinstance(e, UnboundLocalError):
        return
    found = _LOCAL.search(str(e))   # the interpreter sets no `name` on an UnboundLocalError
    name = found.group(1) if found else None
    frame = _innermost(e.__traceback__)
    if not name or frame is None or name not in frame.f_globals:
        return
    fn = frame.f_code.co_qualname
    e.add_note(
        f"elasticd: `{name}` is a module global, but {fn}() also assigns `{name}`, which makes it a local variable "
        f"of the whole function, so this read, before that assignment, does not see the module's value. Top-level "
        f"code moved into a function changes meaning this way. Give the local another name, or copy the module's "
        f"value in first (`{name} = globals()[\"{name}\"]` at the top of {fn}()).")
