"""Between a node daemon and its island scheduler: hello, heartbeats carrying full job state, commands."""

from __future__ import annotations

from dataclasses import field
from typing import Any, ClassVar

from elasticd.protocol.wire import Message, message, record


@record
class DeviceInfo:
    device_id: str                # e.g. "cpu:0", "cuda:1" (unique within the node)
    type: str                     # "cpu" | "cuda"
    index: int
    name: str = ""


@record
class AgentReport:
    rank: int                     # physical rank p of M
    device_id: str
    pid: int
    alive: bool
    connected: bool               # the agent said hello on the control socket
    exitcode: int | None = None
    rss: int = 0                  # bytes
    cpu: float = 0.0              # percent of one core


@record
class JobReport:
    """What a node knows about one job; repeated in every heartbeat until the scheduler forgets it."""

    job_id: str
    state: str                    # "launching" | "running" | "ended"
    ranks: list[int]
    master_port: int = 0          # chosen by the node hosting rank 0
    step: int = 0
    steps_per_s: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    ok: bool = True               # for "ended": every local agent exited 0
    error: dict[str, Any] | None = None
    agents: list[AgentReport] = field(default_factory=list)
    resizes: list[dict[str, Any]] = field(default_factory=list)   # AgentResized infos of the lead agent


@message
class NodeHello(Message):
    """First message of a node (and again whenever the scheduler does not know it)."""

    op: ClassVar[str] = "node_hello"
    node_id: str
    host: str                     # address the node's agents are reachable on (rendezvous)
    devices: list[DeviceInfo]
    pid: int = 0
    jobs: list[JobReport] = field(default_factory=list)


@message
class Welcome(Message):
    op: ClassVar[str] = "welcome"
    node_id: str
    heartbeat_s: float


@message
class NodeStatus(Message):
    """The node's heartbeat: the full state of its jobs, so a lost message is repaired by the next."""

    op: ClassVar[str] = "node_status"
    node_id: str
    seq: int = 0
    jobs: list[JobReport] = field(default_factory=list)


@message
class NodeAck(Message):
    """The scheduler's heartbeat: `forget` lists finished jobs the node may drop from its reports."""

    op: ClassVar[str] = "node_ack"
    seq: int = 0
    forget: list[str] = field(default_factory=list)


@message
class NodeBye(Message):
    op: ClassVar[str] = "node_bye"
    node_id: str


@record
class RankPlacement:
    rank: int
    device_id: str


@message
class LaunchJob(Message):
    """Start this node's agents of a job. master_port 0: this node hosts rank 0 and picks the port."""

    op: ClassVar[str] = "launch_job"
    job_id: str
    script: str
    func: str | None
    workers: int
    world: int
    placements: list[RankPlacement]
    master_addr: str
    master_port: int
    cwd: str = ""
    env: dict[str, str] = field(default_factory=dict)


@message
class KillJob(Message):
    op: ClassVar[str] = "kill_job"
    job_id: str
    reason: str = ""


@message
class ResizeJob(Message):
    """Scheduler -> node: the job moves to `devices` agents, rendezvous at master_addr:master_port
    (the layout epoch `epoch`); the node passes it to its agents as `AgentResize` (live resize, issue 5)."""

    op: ClassVar[str] = "resize_job"
    job_id: str
    devices: int
    epoch: int = 0
    master_addr: str = ""
    master_port: int = 0
