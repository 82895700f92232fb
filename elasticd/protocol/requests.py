"""Requests from the CLI (to a daemon, relayed to the scheduler, or to a scheduler directly) and their replies."""

from __future__ import annotations

from dataclasses import field
from typing import ClassVar

from elasticd.protocol import limits as L
from elasticd.protocol.nodes import bad_blocks
from elasticd.protocol.wire import Message, message, record


def _job_id(job_id: str | None) -> str | None:
    return None if job_id is None else L.bad_job_id(job_id)


@record
class ScaleAt:
    """One entry of a job's resize schedule: after step `step` (logical rank 0's count), run on `devices`."""

    step: int
    devices: int
    blocks: list[int] = field(default_factory=list)   # the new layout's block sizes (empty: the scheduler's)


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
    snapshot_every: str = "30s"   # periodic snapshots to recover from: steps ("20"), seconds ("30s"), "0"
    max_restarts: int = 3         # recoveries after infrastructure failures before the job fails
    torchrun: bool = False        # no @elastic function (torchrun mode): the scheduler resizes it by restarting it
    stuck_after: str = "auto"     # when an agent counts as stuck and is fenced (elasticd/core/watchdog.py)
    run_as: str = ""              # the Unix user its agents run as (admins only; "": the key's or the node's)
    # Resizes at exact steps (`--scale-at`): the agents stop after each step and wait for the resize.
    scale_at: list[ScaleAt] = field(default_factory=list)
    threads: int = 0              # torch threads per agent (0: the node's cores split between its agents)
    device_memory: int = 0        # bytes per device for replicated plus ctx.private state (0: no budget)
    # The starting layout's block sizes (`--layout`; empty: the scheduler's): the job runs on len(blocks) devices.
    blocks: list[int] = field(default_factory=list)

    def check(self) -> str | None:
        if (why := L.bad_scale_at([(e.step, e.devices) for e in self.scale_at], self.workers)):
            return f"scale_at: {why}"
        for e in self.scale_at:
            if (why := bad_blocks(e.blocks, e.devices, self.workers)):
                return f"scale_at: after step {e.step}: {why}"
        if self.blocks and (why := bad_blocks(self.blocks, len(self.blocks), self.workers)):
            return why
        if (why := L.bad_agent_options(self.threads, self.device_memory)):
            return why
        if self.run_as and (why := L.bad_user_name(self.run_as)):
            return f"run_as: {why}"
        if not 1 <= self.workers <= L.MAX_WORKERS:
            return f"workers must be in 1..{L.MAX_WORKERS}, got {self.workers}"
        for what, v in (("min_devices", self.min_devices), ("max_devices", self.max_devices)):
            if not 0 <= v <= L.MAX_WORKERS:
                return f"{what} must be in 0..{L.MAX_WORKERS}, got {v}"
        if abs(self.priority) > L.MAX_PRIORITY:
            return f"priority must be in -{L.MAX_PRIORITY}..{L.MAX_PRIORITY}, got {self.priority}"
        if len(self.env) > L.MAX_ENV_ITEMS:
            return f"env has {len(self.env)} variables, at most {L.MAX_ENV_ITEMS} are allowed"
        size = sum(len(k.encode("utf-8", "surrogatepass")) + len(v.encode("utf-8", "surrogatepass"))
                   for k, v in self.env.items())
        if size > L.MAX_ENV_BYTES:
            return f"env holds {size} bytes, at most {L.MAX_ENV_BYTES} are allowed"
        for k, v in self.env.items():
            if not k or "=" in k or "\x00" in k or "\x00" in v:
                return f"env variable {k[:80]!r}: names must be non-empty without '=', values without NUL"
        return (L.bad_text("script", self.script, L.MAX_PATH, path=True)
                or (L.bad_text("cwd", self.cwd, L.MAX_PATH, path=True) if self.cwd else None)
                or (L.bad_text("func", self.func, L.MAX_NAME) if self.func is not None else None)
                or L.bad_text("name", self.name, L.MAX_NAME))


@message
class Submitted(Message):
    op: ClassVar[str] = "submitted"
    job_id: str


@message
class Stop(Message):
    op: ClassVar[str] = "stop_job"
    job_id: str

    def check(self) -> str | None:
        return _job_id(self.job_id)


@message
class Scale(Message):
    """Ask for M devices: a queued job starts on exactly M; a running one resizes live at its next step
    boundary (and keeps M: the policy no longer resizes it)."""

    op: ClassVar[str] = "scale_job"
    job_id: str
    devices: int

    def check(self) -> str | None:
        if abs(self.devices) > L.MAX_WORKERS:   # within that, the scheduler answers with the job's own 1..N
            return f"devices must be in 1..{L.MAX_WORKERS}, got {self.devices}"
        return _job_id(self.job_id)


@message
class Drain(Message):
    """Move every job off `node_id` live at its next step boundary and give the node no new work;
    jobs still there after `deadline_s` (None: no deadline) are stopped and restarted from their snapshots
    elsewhere (elasticd.scheduler.recovery), naming the drain."""

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

    def check(self) -> str | None:
        if len(self.offsets) > L.MAX_LOG_OFFSETS:
            return f"offsets names {len(self.offsets)} files, at most {L.MAX_LOG_OFFSETS}"
        return _job_id(self.job_id) or L.bad_text("node id", self.node_id, L.MAX_NAME)


@message
class LogsReply(Message):
    op: ClassVar[str] = "logs_reply"
    node_id: str                  # the node these logs are from (agents elsewhere log there)
    chunks: dict[str, str]        # file name -> text read from its offset
    offsets: dict[str, int]       # file name -> offset to ask for next


@message
class Shutdown(Message):
    op: ClassVar[str] = "shutdown"
