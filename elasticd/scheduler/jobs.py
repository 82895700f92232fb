"""The job table's records and their lifecycle."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from elasticd.core.errors import RuntimeFault
from elasticd.core.lifecycle import ResizeOutcome
from elasticd.core.records import Recovery, ResizeEntry
from elasticd.protocol.requests import ScaleAt
from elasticd.protocol.spans import PortionSpec
from elasticd.protocol.status import AgentRow
from elasticd.resize_plan import ResizePlan

RESIZE = "resize"   # the `kind` of a restart at a new size (a torchrun-mode resize), beside the failure causes


@dataclass(slots=True)
class RecoveryInFlight:
    """A restart under way (elasticd.scheduler.recovery): `record`, what the job's history keeps once the job
    has stepped again (the schema `elasticd run` records too), and what the scheduler needs until then."""

    record: Recovery
    kind: str | None                   # the failure's cause (elasticd.core.failures.Cause), or RESIZE
    error: dict[str, Any] = field(default_factory=dict)        # the report that started it (empty: a resize)
    gone: list[str] = field(default_factory=list)              # nodes where none of its agents runs any more
    placement: list[list[str]] = field(default_factory=list)   # RESIZE: the new devices, [node, device] each
    blocks: list[int] = field(default_factory=list)            # RESIZE: the new layout's block sizes
    fell_back: bool = False            # RESIZE: its new devices were taken meanwhile; it restarts on its own

    @property
    def cause(self) -> str:
        return self.record.cause

    @classmethod
    def from_doc(cls, d: dict[str, Any]) -> RecoveryInFlight:
        if "record" not in d:   # also read: the record as one flat map, as a job table may hold it
            fields = ("cause", "at", "failed_after_step", "from_devices", "detected_after")
            record = Recovery(**{k: d[k] for k in fields if k in d}, devices=d.get("devices", d["from_devices"]))
            d = {"kind": d.get("kind"), "error": d.get("error", {}), "gone": d.get("gone", []),
                 "placement": d.get("placement", []), "blocks": d.get("blocks", []),
                 "fell_back": d.get("fell_back", False), "record": record}
        else:
            d = {**d, "record": Recovery(**d["record"])}
        return cls(**d)


class JobState(str, Enum):
    """Lifecycle of a job in the island scheduler.

    ``queued`` until the policy finds devices for it; a portion of a job spanning islands is then
    ``reserved`` (its devices held, nothing launched) until the federation front starts it
    (elasticd.scheduler.portions); then ``starting`` while the nodes spawn its M
    agents (gang: the job holds all M devices or none); ``running`` once every node reports its
    agents up; ``resizing`` while live resize moves it to another M, then ``running``
    again, or ``starting`` once more when the resize failed half-way and the job restarts on the
    devices it had from the snapshot its agents saved at that resize (elasticd.scheduler.rollback).
    ``recovering`` after an infrastructure failure (an agent killed, a node lost) while its remaining
    agents are stopped; then ``starting`` again from its newest periodic snapshot, or ``queued`` when too
    few of its devices are left (elasticd.scheduler.recovery).
    It ends ``finished`` (every agent exited 0), ``failed`` (an agent raised, a node was
    lost, or the agents did not come up in time) or ``stopped`` (`elasticd stop`). A job whose
    start is interrupted by a node loss goes back to ``queued``: none of its agents keep running.
    """

    QUEUED = "queued"
    RESERVED = "reserved"
    STARTING = "starting"
    RUNNING = "running"
    RESIZING = "resizing"
    RECOVERING = "recovering"
    FINISHED = "finished"
    FAILED = "failed"
    STOPPED = "stopped"

    @property
    def active(self) -> bool:
        """Holds devices (its agents are, or are about to be, running)."""
        return self in (JobState.RESERVED, JobState.STARTING, JobState.RUNNING, JobState.RESIZING,
                        JobState.RECOVERING)

    @property
    def terminal(self) -> bool:
        return self in (JobState.FINISHED, JobState.FAILED, JobState.STOPPED)


_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.STARTING, JobState.RESERVED, JobState.STOPPED, JobState.FAILED}),
    JobState.RESERVED: frozenset({JobState.STARTING, JobState.QUEUED, JobState.STOPPED, JobState.FAILED}),
    JobState.STARTING: frozenset({JobState.RUNNING, JobState.QUEUED, JobState.FAILED, JobState.STOPPED,
                                  JobState.RECOVERING}),
    JobState.RUNNING: frozenset({JobState.RESIZING, JobState.FINISHED, JobState.FAILED, JobState.STOPPED,
                                 JobState.RECOVERING}),
    JobState.RESIZING: frozenset({JobState.RUNNING, JobState.STARTING, JobState.FINISHED, JobState.FAILED,
                                  JobState.STOPPED, JobState.RECOVERING}),
    JobState.RECOVERING: frozenset({JobState.STARTING, JobState.QUEUED, JobState.FAILED, JobState.STOPPED}),
    JobState.FINISHED: frozenset(),
    JobState.FAILED: frozenset(),
    JobState.STOPPED: frozenset(),
}


class InvalidTransition(RuntimeFault, RuntimeError):
    """A state change the lifecycle does not allow: a bug in the scheduler, never user input."""


def scale_at_why(e: ScaleAt) -> str:
    """How a --scale-at entry is named in the resize history: "--scale-at 10:2" (":6/2" with blocks)."""
    return f"--scale-at {e.step}:{e.devices}" + (":" + "/".join(map(str, e.blocks)) if e.blocks else "")


def allowed(src: JobState, dst: JobState) -> bool:
    return dst in _TRANSITIONS[src]


@dataclass(slots=True)
class JobSpec:
    """What the user submitted; never changes after submission (except through `scale`)."""

    script: str
    func: str | None
    workers: int
    min_devices: int
    max_devices: int
    priority: int = 0
    name: str = ""
    cwd: str = ""
    env: dict[str, str] = field(default_factory=dict)
    snapshot_every: str = "30s"   # periodic snapshots (elasticd/core/cadence.py); "0": none
    max_restarts: int = 3         # recoveries after infrastructure failures before the job fails
    owner: str = ""   # who submitted it (elasticd.scheduler.authz); "" for rows older than owners
    torchrun: bool = False   # no @elastic function: resized by restarting it (elasticd.scheduler.recovery)
    stuck_after: str = "auto"   # when a node's watchdog fences an agent (elasticd/core/watchdog.py)
    run_as: str = ""   # the Unix user its agents run as ("": each node's default; elasticd/daemon/job_user.py)
    # resizes at exact steps, by step (elasticd.scheduler.scheduled)
    scale_at: list[ScaleAt] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)   # the starting layout asked for (`--layout`; empty: none)
    threads: int = 0          # torch threads per agent (0: the node's default)
    device_memory: int = 0    # per-device budget for replicated plus ctx.private state (0: none)
    portion: PortionSpec | None = None   # one island's part of a job spanning islands (elasticd.scheduler.portions)


@dataclass(slots=True)
class Job:
    job_id: str
    seq: int
    spec: JobSpec
    state: JobState = JobState.QUEUED
    submitted_at: float = 0.0
    state_since: float = 0.0
    started_at: float | None = None
    ended_at: float | None = None
    # rank -> [node_id, device_id]; kept after the job ends so `status` can show where it ran.
    placement: list[list[str]] = field(default_factory=list)
    master_addr: str = ""
    master_port: int = 0
    launched: list[str] = field(default_factory=list)    # nodes sent their LaunchJob
    ready: list[str] = field(default_factory=list)       # nodes whose agents are all up
    ended: list[str] = field(default_factory=list)       # nodes whose agents all exited 0
    # node -> device ids possibly still occupied by agents of this job after it stopped holding
    # them (ended, or sent back to the queue); freed when the node confirms the agents are gone.
    zombies: dict[str, list[str]] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    requested_devices: int | None = None   # M pinned by `elasticd scale` (the policy leaves the job alone)
    # Resize history, one entry per resize asked for, oldest first (the newest 100).
    resizes: list[ResizeEntry] = field(default_factory=list)
    epoch: int = 0                          # layout epoch: +1 per resize started
    resize: ResizePlan | None = None        # the resize in flight
    restore_epoch: int = 0                  # > 0: (re)started from the snapshot of that resize
    history: list[list[Any]] = field(default_factory=list)   # [time, state, reason]
    # Recovery after infrastructure failures (elasticd.scheduler.recovery): the one in flight, the records of
    # those done, the count, the launch generation (reports of agents from before a restart are told apart
    # by it), and whether the next launch restores the newest periodic snapshot.
    recovery: RecoveryInFlight | None = None
    recoveries: list[Recovery] = field(default_factory=list)
    restarts: int = 0
    incarnation: int = 0                    # launches since the first: recoveries and torchrun-mode restarts
    step_offset: int = 0                    # torchrun mode: the step count a restarted script goes on from
    layout_pinned: bool = False             # its blocks are the user's (--layout, --scale-at): no re-layout
    scheduled: int = 0                      # entries of spec.scale_at handled (started, refused or dropped)
    held: int | None = None                 # the step its agents may be held after, waiting for a command
    prepared: int = -1                      # the step of the scheduled grow last prepared ahead (once per entry)
    restore_latest: bool = False
    snapshot: dict[str, Any] = field(default_factory=dict)   # newest complete periodic snapshot: step, bytes
    # Speed-aware placement (elasticd.placement.speeds): logical workers per agent in rank order (empty: the
    # uniform layout; those of a resize in flight are its plan's); and for a re-layout in flight (same
    # devices, other blocks) its reason and predicted gain, for the resize history.
    blocks: list[int] = field(default_factory=list)
    relayout: dict[str, Any] | None = None
    # live progress, reported by the node hosting rank 0 (not persisted on every heartbeat)
    step: int = 0
    steps_per_s: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    agents: dict[str, list[AgentRow]] = field(default_factory=dict)   # node -> its agents' last report

    def transition(self, dst: JobState, now: float, reason: str = "") -> None:
        """Move to `dst`.

        Raises:
            InvalidTransition: if the lifecycle does not allow it.
        """
        if not allowed(self.state, dst):
            raise InvalidTransition(f"job {self.job_id}: {self.state.value} -> {dst.value} not allowed")
        self.state = dst
        self.state_since = now
        self.history.append([round(now, 3), dst.value, reason])
        if dst is JobState.RUNNING and self.started_at is None:
            self.started_at = now
        if dst.terminal:
            self.ended_at = now

    def record_resize(self, plan: ResizePlan, outcome: ResizeOutcome, seconds: float | None = None, note: str = "") -> None:
        """Add a resize's outcome to the job's history (what `status` shows)."""
        entry = ResizeEntry(
            src=plan.src, dst=plan.dst, outcome=outcome.value, at=round(plan.requested_at, 3), why=plan.why,
            epoch=plan.epoch, step=plan.step, blocks=list(plan.blocks), note=note,
            seconds=round(seconds, 3) if seconds is not None else None,
            handover_s=round(plan.handover_s, 3) if plan.handover_s is not None else None,
            stall=round(plan.stall_s, 3) if plan.stall_s is not None else None,
            prepare_s=round(plan.commanded_at - plan.requested_at, 3) if plan.commanded_at is not None else None,
            done_step=self.step if outcome is ResizeOutcome.DONE else None,
            **(self.relayout or {}))   # a re-layout's reason, predicted_gain, blocks_from, blocks_to
        self.relayout = None
        self.add_resize(entry)

    def add_resize(self, entry: ResizeEntry) -> None:
        self.resizes.append(entry)
        del self.resizes[:-100]   # bounded: a job resized by policy for weeks must not grow its row forever

    @property
    def hold_at(self) -> list[int]:
        """The steps its agents stop after, waiting for a scheduled resize: those not handled yet."""
        return [e.step for e in self.spec.scale_at[self.scheduled:]]

    def refuse_scheduled(self, e: ScaleAt, note: str, now: float) -> None:
        """Record the --scale-at entry `e` as refused, from the size the job has."""
        self.add_resize(ResizeEntry(src=len(self.placement), dst=e.devices, outcome=ResizeOutcome.REFUSED.value,
                                    at=round(now, 3), why=scale_at_why(e), step=e.step, blocks=list(e.blocks),
                                    note=note))

    def drop_schedule(self, reason: str, now: float) -> None:
        """The agents refused a resize and dropped their held steps (agent/slicer/boundary.py): so does
        the schedule, each entry recorded as refused."""
        for e in self.spec.scale_at[self.scheduled:]:
            self.refuse_scheduled(e, f"dropped: an earlier resize was refused ({reason})", now)
        self.scheduled = len(self.spec.scale_at)

    @property
    def grow_ahead(self) -> bool:
        """A scheduled grow prepared ahead of its step is in flight (elasticd.scheduler.scheduled): its devices
        are held for a step the job may not have reached yet."""
        return self.resize is not None and self.resize.ahead and self.state is JobState.RESIZING

    @property
    def entered_steps(self) -> bool:
        """Rank 0 reported a `ctx.steps` step boundary (only those reports carry `total_steps`): the only
        place the job can be resized. A job that never does cannot honour a scale."""
        return "total_steps" in self.metrics

    @property
    def nodes(self) -> list[str]:
        """Nodes of the placement, in rank order of first appearance."""
        seen: dict[str, None] = {}
        for node, _dev in self.placement:
            seen.setdefault(node, None)
        return list(seen)

    def ranks_on(self, node: str) -> list[int]:
        return [r for r, (n, _d) in enumerate(self.placement) if n == node]

    def to_doc(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = self.state.value
        d["resizes"] = [r.to_dict() for r in self.resizes]   # under the wire's "from" and "to"
        return d

    @classmethod
    def from_doc(cls, d: dict[str, Any]) -> Job:
        d = dict(d)
        spec = dict(d["spec"])
        spec["scale_at"] = [ScaleAt(**e) for e in spec.get("scale_at", [])]
        spec["portion"] = PortionSpec(**spec["portion"]) if spec.get("portion") else None
        d["spec"] = JobSpec(**spec)
        d["state"] = JobState(d["state"])
        if d.get("resize") is not None:
            d["resize"] = ResizePlan(**d["resize"])
        if d.get("recovery") is not None:
            d["recovery"] = RecoveryInFlight.from_doc(d["recovery"])
        d["resizes"] = [ResizeEntry.from_dict(r) for r in d.get("resizes", [])]
        d["recoveries"] = [Recovery.from_dict(r) for r in d.get("recoveries", [])]
        # The agents' last reports: refreshed by the next heartbeats, so a row of another version starts empty.
        try:
            d["agents"] = {node: [AgentRow(**a) for a in rows] for node, rows in d.get("agents", {}).items()}
        except TypeError:
            d["agents"] = {}
        return cls(**d)
