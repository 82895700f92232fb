"""glibc malloc settings for an agent whose worker threads run one at a time.

Every thread gets its own malloc arena by default, and glibc raises its mmap threshold after the first
large free, so later large tensors come from the thread's arena and stay there when freed: RSS grew
with the number of hosted workers although only one runs at a time (tests/jobs/memory_job.py: 8 hosted
workers reached 1.65-1.78x the peak RSS of 1). So:

- a fixed mmap threshold: tensors from it up are mmapped and returned on free;
- one arena: the worker holding the baton reuses what the previous one freed, so free memory kept for
  reuse is one worker's worth, not one per worker;
- a high trim threshold: a fixed mmap threshold also fixes the trim threshold at 128 KiB, and then every
  free at the top of the heap gave memory back that the next worker faulted in again, page by page
  (N=8, M=1, 0.66M-parameter MLP in deterministic mode: ~7,500 page faults and 2-4 ms of system time a
  step, and 1.5-1.8x the step time it takes with the trim threshold raised).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_done = False


def tune_malloc() -> None:
    """Once, glibc only, before worker threads exist: ELASTICD_MMAP_THRESHOLD bytes (default 4 MiB, 0
    leaves glibc's defaults alone), ELASTICD_TRIM_THRESHOLD bytes (default 64 MiB), one arena."""
    global _done
    if _done:
        return
    _done = True
    mmap = int(os.environ.get("ELASTICD_MMAP_THRESHOLD", str(4 << 20)))
    trim = int(os.environ.get("ELASTICD_TRIM_THRESHOLD", str(64 << 20)))
    name = ctypes.util.find_library("c")
    if not name or mmap <= 0:
        return
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return
    if not hasattr(libc, "mallopt"):
        return
    for option, value, what in ((_M_MMAP_THRESHOLD, mmap, "M_MMAP_THRESHOLD"),
                                (_M_TRIM_THRESHOLD, trim, "M_TRIM_THRESHOLD"), (_M_ARENA_MAX, 1, "M_ARENA_MAX")):
        if libc.mallopt(option, value) != 1:
            log.debug("mallopt(%s) not available: worker memory or page faults may grow with their number", what)
