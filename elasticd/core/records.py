"""Records a job's history keeps, one schema whoever ran the job (the scheduler or `elasticd run`).

The same records travel in `elasticd status` replies (elasticd.protocol.status), decoded strictly like any
message field. A field whose name on the wire is a Python keyword says so in its metadata
(`field(metadata=WIRE_FROM)`): a resize's `src` and `dst` are "from" and "to" in every document.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

R = TypeVar("R")

WIRE_FROM = {"wire": "from"}
WIRE_TO = {"wire": "to"}


def wire_name(f: dataclasses.Field) -> str:
    """The key a field is kept and sent under: its name, or `metadata["wire"]` where that key is a Python
    keyword (a resize's "from" and "to"). The wire (elasticd.protocol.wire) and the job table both use it."""
    return f.metadata.get("wire", f.name)


def as_row(record: Any) -> dict[str, Any]:
    """A record as a plain map under its fields' wire names (a job table's row, `elasticd run --summary`)."""
    d = dataclasses.asdict(record)
    return {wire_name(f): d[f.name] for f in dataclasses.fields(record)}


def from_row(cls: type[R], d: dict[str, Any]) -> R:
    """The record `as_row` wrote; keys this version does not know are left out (a row is never lost for
    them)."""
    names = {wire_name(f): f.name for f in dataclasses.fields(cls)}
    return cls(**{names[k]: v for k, v in d.items() if k in names})


@dataclass(slots=True)
class Recovery:
    """One restart after an infrastructure failure (an agent killed, a node lost)."""

    cause: str                        # what failed, in words
    at: float                         # when the failure was detected: wall-clock seconds since the epoch
    failed_after_step: int            # the last step an agent completed before it; -1: none
    from_devices: int                 # devices the job had
    devices: int                      # devices it restarted on
    resumed_from: int | None = None   # the step its snapshot resumed at (None: not resumed yet)
    steps_redone: int | None = None   # steps computed again: those after the snapshot, up to the failure
    seconds: float | None = None      # from the detection to the first step completed after the restart
    detected_after: float = 0.0       # seconds the job was held before the detection (a stuck agent's stall)

    def resumed(self, step: int, now: float) -> None:
        """The restarted job's first step completed at `now` (wall clock), resuming at `step`."""
        self.resumed_from = step
        self.steps_redone = max(0, self.failed_after_step + 1 - step)
        self.seconds = round(now - self.at, 3)

    def to_dict(self) -> dict[str, Any]:
        return as_row(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recovery:
        return from_row(cls, d)


@dataclass(slots=True)
class ResizeEntry:
    """One resize asked of a job, as its history keeps it (`to_dict`: "from" and "to" for `src` and `dst`)."""

    src: int = dataclasses.field(metadata=WIRE_FROM)   # devices before
    dst: int = dataclasses.field(metadata=WIRE_TO)     # devices asked for
    outcome: str                      # a ResizeOutcome's value
    at: float                         # when it was asked: wall-clock seconds since the epoch
    why: str = ""                     # who asked: a user's scale, the policy, a drain, a --scale-at schedule
    epoch: int | None = None          # the scheduler's resize number (None: `elasticd run`)
    step: int | None = None           # the last step before it: where the agents stopped
    blocks: list[int] = dataclasses.field(default_factory=list)   # the new layout's block sizes (empty: uniform)
    seconds: float | None = None      # from the request to the first step at the new size
    stall: float | None = None        # training paused: last step at the old size to first at the new one
    handover_s: float | None = None   # rank 0's own time from the vote to the new group
    prepare_s: float | None = None    # joiners warming up before the agents were told
    done_step: int | None = None      # rank 0's step when the scheduler saw it done
    note: str = ""                    # why it was refused, aborted or not applied
    # A re-layout (same devices, other block sizes): why, and what it was predicted to gain.
    reason: str | None = None
    predicted_gain: float | None = None
    blocks_from: list[int] | None = None
    blocks_to: list[int] | None = None
    predicted_s: float | None = None        # the cost model's step time on the new blocks
    predicted_from_s: float | None = None   # and on the old ones

    def to_dict(self) -> dict[str, Any]:
        return as_row(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ResizeEntry:
        return from_row(cls, d)
