"""Between an agent process and the node that launched it (a node daemon, or the one `elasticd run` holds in
process): msgpack frames over ZeroMQ, `elasticd.agent.control.zmq_channel` on the agent's side.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar

from elasticd.core.failures import Cause
from elasticd.protocol.wire import Message, Scalar, message


@dataclass(slots=True)
class AgentInfo:
    """Who an agent is, as it says hello (hello means ready to compute)."""

    world: int            # agents in the job
    hosted: list[int]     # the logical ranks it runs
    pid: int
    host: str
    device: str           # torch's name of its device, e.g. "cuda:0"


@dataclass(slots=True)
class AgentError:
    """Why an agent failed. `logical_rank`: the worker that raised (None: the agent itself, e.g. loading)."""

    message: str
    traceback: str = ""
    cause: str = Cause.USER.value   # an agent reports USER or PEER_LOST (elasticd/core/failures.py)
    logical_rank: int | None = None
    host: str = ""

    def as_dict(self, job_id: str, rank: int) -> dict[str, object]:
        """The error record a launcher keeps and reports on (with the job and the agent's physical rank)."""
        return {"rank": rank, "job": job_id, **dataclasses.asdict(self)}


@dataclass(slots=True)
class ResizedInfo:
    """A resize finished on an agent."""

    epoch: int | None     # None: a joiner, which does not know the epoch it joined (its launcher does)
    world: int            # agents after it
    rank: int             # this agent's physical rank after it (the message's `rank` is the one before)
    left: bool            # this agent is not part of the new layout
    seconds: float        # from the command to the re-formed group
    blocks: str           # the new layout, as `Layout` prints it
    step: int | None = None   # the step the agents stopped after (None: a joiner)


@dataclass(slots=True)
class RefusedInfo:
    """The agents agreed at a step boundary that they cannot carry some state across a resize; nothing moved."""

    epoch: int | None     # None: the command had not reached this agent yet
    step: int             # the step they stopped after, and train on from
    message: str          # what could not be carried, as the agent that found it says
    by: int               # that agent's physical rank


@message
class AgentHello(Message):
    """An agent's first word on the daemon's agent socket. `token`: the secret the daemon gave this agent
    process alone (ELASTICD_AGENT_TOKEN); without it no message binds to the agent (a job's process
    cannot speak for another job's agent, elasticd/daemon/supervision.py)."""

    op: ClassVar[str] = "agent_hello"
    job_id: str
    rank: int
    info: AgentInfo
    token: str = ""


@message
class AgentStep(Message):
    op: ClassVar[str] = "agent_step"
    job_id: str
    rank: int
    step: int
    metrics: dict[str, Scalar] = field(default_factory=dict)
    # This agent's step timing since its last report (elasticd.core.timing): {"hosted": n, "compute_s":
    # mean compute seconds per step summed over its hosted workers, "flush_s": mean physical-collective
    # seconds per step, "steps": k}; empty when no whole step was measured since.
    timing: dict[str, int | float] = field(default_factory=dict)


@message
class AgentDone(Message):
    op: ClassVar[str] = "agent_done"
    job_id: str
    rank: int
    stopped: bool = False   # ended by a stop at a step boundary, not by the function returning


@message
class AgentFailed(Message):
    op: ClassVar[str] = "agent_failed"
    job_id: str
    rank: int
    error: AgentError


@message
class AgentStop(Message):
    """Launcher -> agent: stop at the next step boundary."""

    op: ClassVar[str] = "stop"


@message
class AgentResize(Message):
    """Launcher -> agent: re-form the job's group with `world` agents at master_addr:master_port, at the
    next step boundary; `epoch` names the resize (its snapshot directory for falling back)."""

    op: ClassVar[str] = "resize"
    epoch: int | None = None
    world: int
    master_addr: str
    master_port: int
    standby: bool = False         # an agent that leaves stays warm for a grow still to come (--scale-at)
    # A shrink that keeps these old physical ranks, in their new rank order (a drain: the agents off the
    # node going away); empty: the first `world` ones, as an ordinary shrink.
    keep: list[int] = field(default_factory=list)
    # The new layout's logical workers per agent, in new rank order (sum N, each >= 1); empty: the uniform
    # layout at `world`. At the same `world` with other sizes it is a live re-layout: the same agents,
    # ranks moved between them (agent/resize/moves.py `relayout`).
    blocks: list[int] = field(default_factory=list)
    # Agents per island of the new group, in rank order (its two-level sums, agent/comm/islands.py); empty:
    # as before.
    islands: list[int] = field(default_factory=list)


@message
class AgentJoin(Message):
    """Launcher -> a warm standby agent: become physical rank `rank` of `world`, joining a job that grows
    from `join_from` agents, rendezvous at master_addr:master_port (agent.process `_await_join`)."""

    op: ClassVar[str] = "join"
    rank: int
    world: int
    join_from: int
    master_addr: str
    master_port: int
    # The GPU it takes, named by whoever holds the node's device table (-1: its rank's, or none on CPU). Never
    # the one it had: a standby that left in a shrink may join as another rank, whose GPU is another.
    device_index: int = -1
    islands: list[int] = field(default_factory=list)   # as in AgentResize


@message
class AgentResized(Message):
    """Agent -> launcher: a resize finished here (`rank`: its physical rank before the resize)."""

    op: ClassVar[str] = "agent_resized"
    job_id: str
    rank: int
    info: ResizedInfo


@message
class AgentResizeRefused(Message):
    """Agent -> launcher: the agents agreed at the step boundary that they cannot carry some state across
    the resize (agent/slicer/boundary.py); nothing moved and they train on at the old size. Every agent
    sends one."""

    op: ClassVar[str] = "agent_resize_refused"
    job_id: str
    rank: int
    info: RefusedInfo


# What may travel each way: anything else on an agent's channel is a protocol error, not a command to skip.
AgentCommand = AgentStop | AgentResize | AgentJoin
AgentEvent = AgentHello | AgentStep | AgentDone | AgentFailed | AgentResized | AgentResizeRefused
COMMANDS: tuple[type[Message], ...] = (AgentStop, AgentResize, AgentJoin)
EVENTS: tuple[type[Message], ...] = (AgentHello, AgentStep, AgentDone, AgentFailed, AgentResized,
                                      AgentResizeRefused)
