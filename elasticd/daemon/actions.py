"""What the node's agent supervision core (elasticd.daemon.supervision) asks its I/O shell to do.

The core decides; the shell (elasticd.daemon.processes) starts processes, sends signals, talks on the agents'
socket and touches files. Keeping these as plain records lets the core be tested without any process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from elasticd import protocol as p


@dataclass(slots=True)
class Spawn:
    """Action: start one agent process of `launch.job_id` on `device_id`.

    The shell answers with `Supervision.started` (the pid) or `Supervision.spawn_failed`. A command's
    spawns for one job come in rank order; once one of them fails the core has given up on the rest,
    so the shell starts no further spawn of that job from the same batch.
    """

    launch: p.LaunchJob
    rank: int
    world: int
    device_id: str
    error_name: str          # file name of the agent's error report in the job's error dir
    master_addr: str = ""
    master_port: int = 0
    standby: bool = False    # a warm joiner for a live grow
    restore_epoch: int = 0   # start from the node's resize snapshot of this epoch (0: from scratch)
    restore_latest: bool = False   # recovering: from the newest complete periodic snapshot (agent/resize/periodic.py)
    blocks: list[int] = field(default_factory=list)   # the layout's workers per agent (empty: uniform)
    hold_at: list[int] = field(default_factory=list)  # steps it stops after for a scheduled resize

    @property
    def job_id(self) -> str:
        return self.launch.job_id


@dataclass(slots=True)
class Signal:
    """Action: send SIGTERM or SIGKILL to the process group of agent `pid` (its own session)."""

    pid: int
    sig: Literal["TERM", "KILL"]


@dataclass(slots=True)
class SendToAgent:
    """Action: deliver `msg` to the agent connected as `identity` on the agents' socket."""

    identity: bytes
    msg: p.Message


@dataclass(slots=True)
class Report:
    """Action: the scheduler should hear about this node's jobs now, not at the next heartbeat."""


@dataclass(slots=True)
class DropSnapshots:
    """Action: delete the job's resize snapshots on this node up to epoch `upto` (None: all, and the dir)."""

    job_id: str
    upto: int | None
    span_key: str = ""   # also the periodic snapshots under this key (a portion of a job spanning islands that finished)
    under_key: str = ""  # the resize snapshots live under this key, not the job's directory (a portion's)


Action = Spawn | Signal | SendToAgent | Report | DropSnapshots
