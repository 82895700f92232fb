"""Records a job's history keeps, one schema whoever ran the job (the scheduler or `elasticd run`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Recovery:
    """One restart after an infrastructure failure (an agent killed, a node lost)."""

    cause: str                        # what failed, in words
    at: float                         # when it failed: wall-clock seconds since the epoch
    failed_after_step: int            # the last step reported before it; -1: before the first step boundary
    from_devices: int                 # devices the job had
    devices: int                      # devices it restarted on
    resumed_from: int | None = None   # the step its snapshot resumed at (None: not resumed yet)
    steps_redone: int | None = None   # steps computed again: those after the snapshot, up to the failure
    seconds: float | None = None      # from the failure to the first step after the restart

    def resumed(self, step: int, now: float) -> None:
        """The restarted job's first step came at `now` (wall clock), resuming at `step`."""
        self.resumed_from = step
        self.steps_redone = max(0, self.failed_after_step + 1 - step)
        self.seconds = round(now - self.at, 3)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
