"""Warnings raised through elasticd's wrappers point at the user's line, as without elasticd.

elasticd wraps a few torch callables (constructors of optimizers, schedulers and scalers, clipping,
`backward`, `torch.distributed`: agent/patches.py) with Python functions, one frame each. A warning torch
raises inside one with `stacklevel=2` ("the caller of this function") then names elasticd's wrapper as
its origin: `torch.cuda.amp.GradScaler(...)`'s FutureWarning appeared at agent/capture/carried.py instead
of the script's line, and a filter on the user's module did not match it. Python 3.12's
`skip_file_prefixes` does this for a caller that asks; torch does not ask, so `warnings.warn` is wrapped
here: walking up `stacklevel` frames it steps over the frames of elasticd's runtime, and warns with the
level that lands on the frame the warning would have named without them. A warning whose walk finds no
such frame (torch called by the runtime itself) keeps its level.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from types import FrameType
from typing import Any

from elasticd.agent import patches

_LEDGER = patches.ledger("compat.warning_origin")
_RUNTIME_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep   # elasticd/agent/
_THREADING = os.path.abspath(threading.__file__)


def _ours(frame: FrameType) -> bool:
    return frame.f_code.co_filename.startswith(_RUNTIME_DIR)


def _extra_levels(caller: FrameType, stacklevel: int) -> int:
    """How many of elasticd's frames lie on the way from `caller` (stacklevel 1) up `stacklevel - 1` frames."""
    frame: FrameType | None = caller
    extra = 0
    for _ in range(stacklevel - 1):
        assert frame is not None
        frame = frame.f_back
        while frame is not None and _ours(frame):
            frame, extra = frame.f_back, extra + 1
        if frame is None:
            return 0   # the walk left the stack: the runtime's own thread, nobody's line to name
    if frame is None or frame.f_code.co_filename == _THREADING:
        return 0
    return extra


def install() -> None:
    """Wrap `warnings.warn` (idempotent)."""
    if _LEDGER.active:
        return
    real = warnings.warn

    def warn(message: Any, category: Any = None, stacklevel: int = 1, source: Any = None, **kwargs: Any) -> None:
        extra = _extra_levels(sys._getframe(1), stacklevel) if stacklevel > 1 else 0
        real(message, category, stacklevel + 1 + extra, source, **kwargs)   # kwargs: 3.12's skip_file_prefixes

    warn.__doc__ = real.__doc__
    warn.__wrapped__ = real  # type: ignore[attr-defined]
    _LEDGER.set(warnings, "warn", warn)
