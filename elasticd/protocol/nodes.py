"""Between a node daemon and its island scheduler: hello, heartbeats carrying full job state, commands."""

from __future__ import annotations

from dataclasses import field
from typing import ClassVar

from elasticd.core.watchdog import StuckAfter
from elasticd.protocol.agents import ResizedInfo
from elasticd.protocol.limits import MAX_SCALE_AT, bad_agent_options, bad_snapshot_key, bad_user_name
from elasticd.protocol.wire import Message, Scalar, message, record


def bad_blocks(blocks: list[int], world: int, workers: int | None = None) -> str | None:
    """Why `blocks` is no layout of `workers` logical workers over `world` agents (None: it is one;
    an empty list is the uniform layout)."""
    if not blocks:
        return None
    if len(blocks) != world:
        return f"blocks {blocks[:16]} name {len(blocks)} agents, the layout has {world}"
    if min(blocks) < 1:
        return f"blocks {blocks[:16]}: every agent hosts at least one worker"
    if workers is not None and sum(blocks) != workers:
        return f"blocks {blocks[:16]} sum to {sum(blocks)}, the job has {workers} workers"
    return None


def bad_islands(islands: list[int], world: int) -> str | None:
    """Why `islands` is no cut of `world` agents into islands (None: it is one; empty: none given)."""
    if islands and (min(islands) < 1 or sum(islands) != world or len(islands) > 1024):
        return f"islands {islands[:16]}: agent counts >= 1 that add up to the {world} agents"
    return None


def bad_run_as(name: str) -> str | None:
    return f"run_as: {why}" if name and (why := bad_user_name(name)) else None


def bad_hold_at(steps: list[int]) -> str | None:
    if len(steps) > MAX_SCALE_AT or any(s < 0 for s in steps):
        return f"hold_at: at most {MAX_SCALE_AT} steps, each >= 0"
    return None


def bad_stuck_after(text: str) -> str | None:
    """Why `text` is no --stuck-after (None: it is one)."""
    try:
        StuckAfter.parse(text)
    except ValueError as e:
        return str(e)
    return None


@record
class DeviceInfo:
    device_id: str                # e.g. "cpu:0", "cuda:1" (unique within the node)
    type: str                     # "cpu" | "cuda"
    index: int
    name: str = ""
    # Declared relative speed (`elasticd start --device-speed`, 1.0 = reference; 0: not declared): the
    # scheduler's prior for this device until its agents' step times are measured.
    speed: float = 0.0


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
    standby: bool = False         # a joining agent of a resize still waiting for the hand-over
    epoch: int = 0                # last resize epoch this agent finished (0: none)
    stepped: int = 0              # last resize epoch after which it completed a step at the new size
    left: bool = False            # left the job in a shrink (exits 0; its device frees when it is gone)
    warm: bool = False            # left, and kept warm for the job's coming grow: its device is free already
    completed: int = -1           # the last step it completed, by its beat file (-1: none), read at its exit too
    # The agent's latest step timing (AgentStep.timing): hosted, compute_s, flush_s, steps. Empty: none yet.
    timing: dict[str, int | float] = field(default_factory=dict)


@record
class JobReport:
    """What a node knows about one job; repeated in every heartbeat until the scheduler forgets it."""

    job_id: str
    state: str                    # "launching" | "running" | "ended"
    ranks: list[int]
    master_port: int = 0          # chosen by the node hosting rank 0
    step: int = 0
    steps_per_s: float = 0.0
    metrics: dict[str, Scalar] = field(default_factory=dict)
    ok: bool = True               # for "ended": every local agent exited 0
    # The first cause (protocol/agents.py AgentError.as_dict, or the daemon's words for an agent that died
    # without a report), with the physical rank it came from.
    error: dict[str, Scalar] | None = None
    agents: list[AgentReport] = field(default_factory=list)
    # The lead agent's finished resizes, newest last, each with the epoch this node knows it by.
    resizes: list[ResizedInfo] = field(default_factory=list)
    resize_epoch: int = 0         # the resize this node is preparing or carrying out (0: none)
    resize_port: int = 0          # its rendezvous port, picked by the node hosting rank 0
    resize_error: dict[str, Scalar] | None = None   # a joining agent died before the hand-over; or, with
    # "refused": True, the agents refused the resize at its step boundary ("message": why, "step")
    # The newest resize snapshot kept on this node (agent.fallback) and its parts: logical ranks, -1 for
    # the replicated state. The scheduler falls back to it when a resize fails half-way.
    snapshot_epoch: int = 0
    snapshot_parts: list[int] = field(default_factory=list)
    restore_epoch: int = 0        # the snapshot this node's agents of the job started from (0: none)
    incarnation: int = 0          # the launch's: reports of agents from before a recovery are told apart


@message
class NodeHello(Message):
    """First message of a node (and again whenever the scheduler does not know it)."""

    op: ClassVar[str] = "node_hello"
    node_id: str
    host: str                     # address the node's agents are reachable on (rendezvous)
    devices: list[DeviceInfo]
    pid: int = 0
    jobs: list[JobReport] = field(default_factory=list)

    def check(self) -> str | None:
        for d in self.devices:
            if not 0.0 <= d.speed <= 1e6:   # also refuses NaN
                return f"device {d.device_id}: speed must be in 0..1e6 (0: not declared), got {d.speed}"
        return None


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
    drained: bool = False         # the node is draining and no active job holds anything there any more


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
    devices: int                  # agents of the job, one per device, on every node together
    placements: list[RankPlacement]
    master_addr: str
    master_port: int
    cwd: str = ""
    env: dict[str, str] = field(default_factory=dict)
    restore_epoch: int = 0        # > 0: start from the snapshot this node kept of that resize
    restore_latest: bool = False  # recovering: start from the newest complete periodic snapshot
    snapshot_every: str = "0"     # periodic snapshots: steps ("20"), seconds ("30s"), "0" (none)
    incarnation: int = 0          # +1 per recovery; echoed in this node's reports of the job
    # Logical workers per agent, in rank order (sum = workers); empty: the uniform layout.
    blocks: list[int] = field(default_factory=list)
    stuck_after: str = "auto"     # the node's watchdog fences agents stuck this long (elasticd/core/watchdog.py)
    run_as: str = ""              # the Unix user its agents run as ("": the node's default, elasticd/daemon/job_user.py)
    hold_at: list[int] = field(default_factory=list)   # steps its agents stop after for a scheduled resize
    threads: int = 0              # torch threads per agent (0: the node's cores split between its agents)
    device_memory: int = 0        # bytes per device for replicated plus ctx.private state (0: no budget)
    # A portion of a job spanning islands: its periodic snapshots live under this key, kept for the job's
    # next attempt when this one ends unfinished (elasticd.scheduler.portions).
    snapshot_key: str = ""

    def check(self) -> str | None:
        return (bad_blocks(self.blocks, self.devices, self.workers) or bad_stuck_after(self.stuck_after)
                or bad_snapshot_key(self.snapshot_key)
                or bad_run_as(self.run_as) or bad_hold_at(self.hold_at)
                or bad_agent_options(self.threads, self.device_memory))


@message
class KillJob(Message):
    op: ClassVar[str] = "kill_job"
    job_id: str
    reason: str = ""
    force: bool = False           # no stop command first: the agents are not at a step boundary (a failed resize)


@message
class PrepareResize(Message):
    """Scheduler -> node, first half of a live resize from `devices_from` to `devices` agents (layout `epoch`).

    The node starts the joining ranks placed on it (`joiners`) as warm standby agents, and the node
    hosting rank 0 (`pick_port`) picks the new group's rendezvous port; both are reported in the
    node's heartbeat. The running agents keep training meanwhile. The script fields let a node that
    does not host the job yet start its agents.
    """

    op: ClassVar[str] = "prepare_resize"
    job_id: str
    epoch: int
    devices_from: int
    devices: int
    joiners: list[RankPlacement] = field(default_factory=list)
    pick_port: bool = False
    script: str = ""
    func: str | None = None
    workers: int = 0
    cwd: str = ""
    env: dict[str, str] = field(default_factory=dict)
    snapshot_every: str = "0"     # as in LaunchJob: joiners take their part of the periodic snapshots
    blocks: list[int] = field(default_factory=list)   # the new layout's, as in LaunchJob (empty: uniform)
    stuck_after: str = "auto"     # as in LaunchJob
    run_as: str = ""              # as in LaunchJob
    hold_at: list[int] = field(default_factory=list)   # as in LaunchJob, for the joiners
    threads: int = 0              # as in LaunchJob
    device_memory: int = 0        # as in LaunchJob
    snapshot_key: str = ""        # as in LaunchJob

    def check(self) -> str | None:
        return (bad_blocks(self.blocks, self.devices, self.workers or None) or bad_stuck_after(self.stuck_after)
                or bad_run_as(self.run_as) or bad_hold_at(self.hold_at) or bad_snapshot_key(self.snapshot_key)
                or bad_agent_options(self.threads, self.device_memory))


@message
class ResizeJob(Message):
    """Scheduler -> node, second half: every joiner is warm, so go. The node tells its running agents
    `AgentResize` and its standby joiners `AgentJoin`, rendezvous at master_addr:master_port."""

    op: ClassVar[str] = "resize_job"
    job_id: str
    devices: int
    epoch: int = 0
    master_addr: str = ""
    master_port: int = 0
    devices_from: int = 0
    # A shrink keeping these old ranks, in new rank order (a drain); empty: ranks 0..devices-1 stay.
    keep: list[int] = field(default_factory=list)
    # The new layout's logical workers per agent (empty: uniform). Same `devices` as now with other
    # blocks is a live re-layout: workers move between the agents, none starts or leaves.
    blocks: list[int] = field(default_factory=list)
    # The agents that leave stay warm (the job's --scale-at grows again later): the node keeps them, their
    # devices free, and starts the coming grow's joiners on this node from them instead of from spares.
    standby: bool = False
    # Agents per island of the new layout, in rank order (a job spanning islands: its two-level sums);
    # empty: the islands stay as the agents have them.
    islands: list[int] = field(default_factory=list)

    def check(self) -> str | None:
        return bad_blocks(self.blocks, self.devices) or bad_islands(self.islands, self.devices)


@message
class AbortResize(Message):
    """Scheduler -> node: the resize `epoch` will not happen (a joiner died or never came up, or the job
    ended first; the running agents never heard of it), or did not (after the go, its agents refused it and
    train on at the old size); stop its joiners, and undo what its go changed on the node."""

    op: ClassVar[str] = "abort_resize"
    job_id: str
    epoch: int
    reason: str = ""
