"""Requests from the CLI (to a daemon, relayed to the scheduler, or to a scheduler directly) and their replies."""

from __future__ import annotations

from dataclasses import field
from typing import Any, ClassVar

from elasticd.protocol.wire import Message, message, record


@message
class Submit(Message):
    """A job: the user's script (absolute path, readable on every node) and its placement bounds."""

    op: ClassVar[str] = "submit"
    script: str
    func: str | None = None
    workers: int
    min_devices: int = 1
    max_devices: int = 0          # 0 = workers
    priority: int = 0
    name: str = ""
    cwd: str = ""
    env: dict[str, str] = field(default_factory=dict)


@message
class Submitted(Message):
    op: ClassVar[str] = "submitted"
    job_id: str


@message
class Status(Message):
    op: ClassVar[str] = "status"
    job_id: str | None = None


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
    metrics: dict[str, Any] = field(default_factory=dict)
    script: str = ""
    submitted_at: float = 0.0
    started_at: float | None = None
    ended_at: float | None = None
    error: dict[str, Any] | None = None
    requested_devices: int | None = None
    resizes: list[dict[str, Any]] = field(default_factory=list)   # at, from, to, why, seconds, outcome
    resizing: dict[str, Any] | None = None   # the resize in flight: epoch, from, to, why, phase, at
    history: list[list[Any]] = field(default_factory=list)
    agents: list[dict[str, Any]] = field(default_factory=list)   # rank, node, device, pid, alive, rss, cpu


@record
class NodeInfo:
    node_id: str
    host: str
    alive: bool
    devices: list[str]
    free: list[str]
    last_seen_s: float            # seconds since the last heartbeat
    # While draining (elasticd.scheduler.draining): since, deadline_s (left; None: none), drained,
    # seconds (draining so far, or until drained), waiting (why a job cannot move off yet).
    draining: dict[str, Any] | None = None


@message
class StatusReply(Message):
    op: ClassVar[str] = "status_reply"
    jobs: list[JobInfo]
    nodes: list[NodeInfo]


@message
class Stop(Message):
    op: ClassVar[str] = "stop_job"
    job_id: str


@message
class Scale(Message):
    """Ask for M devices: a queued job starts on exactly M; a running one resizes live at its next step
    boundary (and keeps M: the policy no longer resizes it)."""

    op: ClassVar[str] = "scale_job"
    job_id: str
    devices: int


@message
class Drain(Message):
    """Move every job off `node_id` live at its next step boundary and give the node no new work;
    jobs still there after `deadline_s` (None: no deadline) fail, naming the drain."""

    op: ClassVar[str] = "drain_node"
    node_id: str
    deadline_s: float | None = None


@message
class Undrain(Message):
    """Put a draining node back into service."""

    op: ClassVar[str] = "undrain_node"
    node_id: str


@message
class Logs(Message):
    """Read a job's agent logs from byte `offsets` (per log file name) on.

    `node_id` "" means the daemon asked; another node's logs are fetched through the scheduler.
    """

    op: ClassVar[str] = "logs"
    job_id: str
    node_id: str = ""
    offsets: dict[str, int] = field(default_factory=dict)
    max_bytes: int = 256 * 1024


@message
class LogsReply(Message):
    op: ClassVar[str] = "logs_reply"
    node_id: str                  # the node these logs are from (agents elsewhere log there)
    chunks: dict[str, str]        # file name -> text read from its offset
    offsets: dict[str, int]       # file name -> offset to ask for next


@message
class Shutdown(Message):
    op: ClassVar[str] = "shutdown"
