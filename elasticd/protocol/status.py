"""`elasticd status`: the request, the reply, and the records of a job's and a node's row.

Every part of a row is a record decoded strictly like any message field: the resize and recovery
histories are the job table's own records (elasticd.core.records), the rest are read-only views the
scheduler builds for readers. A map that stays a map holds scalars only (a job's metrics, its error, the
newest snapshot's figures, a node's device speeds).
"""

from __future__ import annotations

from dataclasses import field
from typing import ClassVar

from elasticd.core.records import WIRE_FROM, WIRE_TO, Recovery, ResizeEntry
from elasticd.protocol import limits as L
from elasticd.protocol.requests import ScaleAt
from elasticd.protocol.wire import Message, Scalar, message, record


@message
class Status(Message):
    op: ClassVar[str] = "status"
    job_id: str | None = None
    after: int = 0                # the job list is paged: jobs submitted after the one with this seq

    def check(self) -> str | None:
        return None if self.job_id is None else L.bad_job_id(self.job_id)


@record
class ResizeInFlight:
    """The resize a job is in (elasticd.resize_plan.ResizePlan), as `status` shows it."""

    epoch: int
    src: int = field(metadata=WIRE_FROM)
    dst: int = field(metadata=WIRE_TO)
    why: str
    phase: str                    # a ResizePhase's value
    at: float                     # when it was asked: wall-clock seconds since the epoch
    saved: int                    # snapshot parts written so far (the job's logical ranks plus its replicated state)
    parts: int                    # parts a complete snapshot has


@record
class AgentRow:
    """One agent of a job, as its node last reported it."""

    rank: int                     # physical rank
    node: str
    device: str
    pid: int
    alive: bool
    rss: int                      # bytes
    cpu: float                    # percent of one core
    exitcode: int | None = None
    timing: dict[str, int | float] = field(default_factory=dict)   # latest step: hosted, compute_s, flush_s, steps


@record
class LayoutAgent:
    rank: int
    device: str                   # "NODE/INDEX"
    workers: int                  # logical workers it hosts
    speed: float                  # relative: fitted, else the node's prior
    worker_step_s: float | None   # fitted seconds per worker-step (None: not measured yet)


@record
class JobLayout:
    """Speed-aware placement (elasticd.placement.speeds): where the blocks went and what they cost."""

    agents: list[LayoutAgent]
    predicted_step_s: float
    measured_step_s: float | None
    comm_s: float


@record
class JobInfo:
    """One row of `elasticd status`."""

    job_id: str
    name: str
    state: str
    workers: int
    devices: int                  # M: physical agents (0 while queued)
    min_devices: int
    max_devices: int
    priority: int
    nodes: list[str]
    step: int = 0
    steps_per_s: float = 0.0
    metrics: dict[str, Scalar] = field(default_factory=dict)
    script: str = ""
    submitted_at: float = 0.0
    started_at: float | None = None
    ended_at: float | None = None
    error: dict[str, Scalar] | None = None
    requested_devices: int | None = None
    resizes: list[ResizeEntry] = field(default_factory=list)   # every resize asked for, oldest first
    resizing: ResizeInFlight | None = None
    history: list[tuple[float, str, str]] = field(default_factory=list)   # (at, state, reason)
    agents: list[AgentRow] = field(default_factory=list)
    recoveries: list[Recovery] = field(default_factory=list)   # one per restart after an infrastructure failure
    snapshot: dict[str, Scalar] | None = None   # newest complete periodic snapshot: step, bytes (per node)
    blocks: list[int] = field(default_factory=list)   # logical workers per agent, rank order (empty: uniform)
    layout: JobLayout | None = None
    run_as: str = ""   # the Unix user its agents run as ("": each node's --jobs-as user)
    scale_at: list[ScaleAt] = field(default_factory=list)   # the --scale-at entries still to come
    portion_of: str = ""      # a portion of a job spanning islands: that job at its front, and which ranks


@record
class DrainInfo:
    """A draining node (elasticd.scheduler.draining)."""

    since: float                  # wall-clock seconds since the epoch
    deadline_s: float | None      # seconds left (None: no deadline)
    drained: bool
    seconds: float                # draining so far, or until drained
    waiting: str = ""             # why a job cannot move off yet


@record
class NodeInfo:
    node_id: str
    host: str
    alive: bool
    devices: list[str]
    free: list[str]
    last_seen_s: float            # seconds since the last heartbeat
    draining: DrainInfo | None = None
    speeds: dict[str, float] = field(default_factory=dict)   # device id -> relative speed (fitted, else prior)


@message
class StatusReply(Message):
    op: ClassVar[str] = "status_reply"
    jobs: list[JobInfo]
    nodes: list[NodeInfo]
    next_after: int = 0           # > 0: more jobs follow; ask again with after=next_after
