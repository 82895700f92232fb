"""When a live re-layout is worth its cost: a clear gain, seen for a while, not too soon after the last one.

A re-layout goes through the resize path (a snapshot, agents restarted or re-mapped): seconds of lost work.
Measured step times are noisy, so a single check that promises 12% would make a job chase noise, and two
layouts within a few percent of each other would make it oscillate. The gate asks for a gain of at least
`min_gain` on `patience` consecutive checks, and `cooldown_s` since the job's last re-layout.

Pass the model's prediction for the current layout as `current_s`, not the measured step: both sides of
the gain then come from the same model, so its error does not read as gain.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from elasticd.placement.placer import Placement


@dataclass
class RelayoutGate:
    """Decides when a live re-layout is worth it: gain >= min_gain (default 0.10 = 10% shorter predicted step)
    seen on `patience` consecutive checks, and at least `cooldown_s` since the last re-layout of that job."""

    min_gain: float = 0.10
    patience: int = 3
    cooldown_s: float = 30.0
    _streak: dict[str, int] = field(default_factory=dict)
    _last: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.min_gain) and 0 <= self.min_gain < 1):
            raise ValueError(f"min_gain must be in [0, 1), got {self.min_gain}")
        if self.patience < 1:
            raise ValueError(f"patience must be >= 1, got {self.patience}")
        if not (math.isfinite(self.cooldown_s) and self.cooldown_s >= 0):
            raise ValueError(f"cooldown_s must be >= 0, got {self.cooldown_s}")

    def check(self, job_id: str, current_s: float, proposed: Placement, now: float) -> tuple[bool, float]:
        """(go, gain): gain = 1 - proposed / current predicted step; go once the gate's conditions hold."""
        ok = math.isfinite(current_s) and current_s > 0 and math.isfinite(proposed.predicted_s)
        gain = 1.0 - proposed.predicted_s / current_s if ok else 0.0
        streak = self._streak.get(job_id, 0) + 1 if gain >= self.min_gain else 0
        self._streak[job_id] = streak
        last = self._last.get(job_id)
        cooled = last is None or now - last >= self.cooldown_s
        return streak >= self.patience and cooled, gain

    def done(self, job_id: str, now: float) -> None:
        """`job_id` was re-laid-out (or resized for any reason) at `now`: cool down, start counting afresh."""
        self._last[job_id] = float(now)
        self._streak[job_id] = 0

    def forget(self, job_id: str) -> None:
        self._streak.pop(job_id, None)
        self._last.pop(job_id, None)

    def to_dict(self) -> dict:
        return {"min_gain": self.min_gain, "patience": self.patience, "cooldown_s": self.cooldown_s,
                "streak": dict(self._streak), "last": dict(self._last)}

    @classmethod
    def from_dict(cls, d: dict) -> RelayoutGate:
        """Raises:
            ValueError: on a malformed dict.
        """
        try:
            gate = cls(float(d["min_gain"]), int(d["patience"]), float(d["cooldown_s"]))
            gate._streak = {str(k): int(v) for k, v in d.get("streak", {}).items()}
            gate._last = {str(k): float(v) for k, v in d.get("last", {}).items()}
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed re-layout gate: {exc!r}") from exc
        return gate
