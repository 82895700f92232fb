"""Per-step timing an agent reports, so a scheduler can learn how fast its device is.

Per physical step an agent spends its wall time in two ways: its hosted workers computing in turn
(the time the baton is held, hand-overs included) and physical collectives (flushes, and the step
boundary's vote). A slow agent's peers wait for it inside their collectives, so collective time absorbs
the waiting and compute time is what measures a device's speed: `compute_s / hosted` is seconds per
logical worker-step. The report, in `AgentStep.timing`, is
`{"hosted": n, "compute_s": mean, "flush_s": mean, "steps": k}`: means over the k steps since the last
report. Pure: the runtime feeds it `time.perf_counter()` readings it takes anyway.
"""

from __future__ import annotations

import math
from typing import Any

KEYS = ("hosted", "compute_s", "flush_s", "steps")
# The step metric in which rank 0 reports, by its own clock, how long training paused for the resize it
# came out of: from its last step before it to its first step after (a supervisor's, not the user's).
STALL_METRIC = "resize_stall_s"


class StepTiming:
    """Accumulates one agent's compute and collective seconds between reports."""

    __slots__ = ("hosted", "_last", "_flush", "_compute_sum", "_flush_sum", "_steps")

    def __init__(self, hosted: int) -> None:
        self.hosted = hosted
        self._last: float | None = None   # the previous step boundary; None before the first
        self._flush = 0.0                 # collective seconds since the previous boundary
        self._compute_sum = 0.0
        self._flush_sum = 0.0
        self._steps = 0

    def add_flush(self, seconds: float) -> None:
        """Seconds spent in a physical collective."""
        self._flush += seconds

    def boundary(self, now: float) -> None:
        """A step boundary at `now`: the interval since the previous one was one step of every hosted worker.
        The first boundary only starts the clock (before it: imports, model building, a restore)."""
        if self._last is not None:
            wall = now - self._last
            self._compute_sum += max(0.0, wall - self._flush)
            self._flush_sum += min(self._flush, wall)
            self._steps += 1
        self._last = now
        self._flush = 0.0

    def take(self) -> dict[str, Any]:
        """The means since the last `take`, and start over ({} when no whole step was measured)."""
        if self._steps == 0:
            return {}
        out = {"hosted": self.hosted, "compute_s": self._compute_sum / self._steps,
               "flush_s": self._flush_sum / self._steps, "steps": self._steps}
        self._compute_sum = self._flush_sum = 0.0
        self._steps = 0
        return out


def clean_timing(t: dict[str, Any]) -> dict[str, Any]:
    """A timing report checked and typed (it crossed a process boundary).

    Raises:
        ValueError: a key missing, or a value that is no count or no finite non-negative time.
    """
    try:
        hosted, steps = t["hosted"], t["steps"]
        compute, flush = float(t["compute_s"]), float(t["flush_s"])
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"timing report {t!r} lacks {KEYS}: {e}") from None
    if not (isinstance(hosted, int) and isinstance(steps, int) and hosted >= 1 and steps >= 1):
        raise ValueError(f"timing report {t!r}: hosted and steps must be counts >= 1")
    if not all(math.isfinite(v) and v >= 0 for v in (compute, flush)):
        raise ValueError(f"timing report {t!r}: times must be finite and >= 0")
    return {"hosted": hosted, "compute_s": compute, "flush_s": flush, "steps": steps}


def merge_timing(a: dict[str, Any] | None, b: dict[str, Any]) -> dict[str, Any]:
    """Two consecutive reports of one agent as one (step-weighted means); `b`'s hosted count wins."""
    if not a:
        return dict(b)
    if not b:
        return dict(a)
    n = a["steps"] + b["steps"]
    return {"hosted": b["hosted"],
            "compute_s": (a["compute_s"] * a["steps"] + b["compute_s"] * b["steps"]) / n,
            "flush_s": (a["flush_s"] * a["steps"] + b["flush_s"] * b["steps"]) / n, "steps": n}
