"""Between an agent process and whoever launched it: its node daemon (msgpack frames over ZeroMQ,
`elasticd.agent.control.zmq_channel`) or `elasticd run` (the same messages as JSON lines over pipes,
`elasticd.agent.control.pipe_channel`). Both channels hand the agent the same command objects, and both
launchers read the same event objects, so there is one vocabulary for agents however they were started.
"""

from __future__ import annotations

from dataclasses import field
from typing import Any, ClassVar

from elasticd.protocol.wire import Message, message


@message
class AgentHello(Message):
    op: ClassVar[str] = "agent_hello"
    job_id: str
    rank: int
    info: dict[str, Any] = field(default_factory=dict)


@message
class AgentStep(Message):
    op: ClassVar[str] = "agent_step"
    job_id: str
    rank: int
    step: int
    metrics: dict[str, Any] = field(default_factory=dict)
    # This agent's step timing since its last report (elasticd.core.timing): {"hosted": n, "compute_s":
    # mean compute seconds per step summed over its hosted workers, "flush_s": mean physical-collective
    # seconds per step, "steps": k}; empty when no whole step was measured since.
    timing: dict[str, Any] = field(default_factory=dict)


@message
class AgentDone(Message):
    op: ClassVar[str] = "agent_done"
    job_id: str
    rank: int
    result: dict[str, Any] = field(default_factory=dict)


@message
class AgentFailed(Message):
    op: ClassVar[str] = "agent_failed"
    job_id: str
    rank: int
    error: dict[str, Any] = field(default_factory=dict)


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
    standby: bool = False         # an agent that leaves stays warm for a later grow (`elasticd run` only)
    # A shrink that keeps these old physical ranks, in their new rank order (a drain: the agents off the
    # node going away); empty: the first `world` ones, as an ordinary shrink.
    keep: list[int] = field(default_factory=list)
    # The new layout's logical workers per agent, in new rank order (sum N, each >= 1); empty: the uniform
    # layout at `world`. At the same `world` with other sizes it is a live re-layout: the same agents,
    # ranks moved between them (agent/resize/moves.py `relayout`).
    blocks: list[int] = field(default_factory=list)


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


@message
class AgentResized(Message):
    """Agent -> launcher: a resize finished here: {"epoch", "world", "rank", "left", "seconds"}."""

    op: ClassVar[str] = "agent_resized"
    job_id: str
    rank: int
    info: dict[str, Any] = field(default_factory=dict)


@message
class AgentResizeRefused(Message):
    """Agent -> launcher: the agents agreed at the step boundary that they cannot carry some state across
    the resize (agent/slicer/boundary.py); nothing moved and they train on at the old size. Every agent
    sends one: {"epoch" (None: the command had not come yet), "step", "message", "by" (the agent whose
    worker could not be captured)}."""

    op: ClassVar[str] = "agent_resize_refused"
    job_id: str
    rank: int
    info: dict[str, Any] = field(default_factory=dict)


# What may travel each way: anything else on an agent's channel is a protocol error, not a command to skip.
AgentCommand = AgentStop | AgentResize | AgentJoin
AgentEvent = AgentHello | AgentStep | AgentDone | AgentFailed | AgentResized | AgentResizeRefused
COMMANDS: tuple[type[Message], ...] = (AgentStop, AgentResize, AgentJoin)
EVENTS: tuple[type[Message], ...] = (AgentHello, AgentStep, AgentDone, AgentFailed, AgentResized,
                                      AgentResizeRefused)
