"""Between an agent process and its node daemon (agent.control_zmq on the agent side)."""

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
    """Daemon -> agent: stop at the next step boundary."""

    op: ClassVar[str] = "stop"


@message
class AgentResize(Message):
    """Daemon -> agent: re-form the job's group with `world` agents at master_addr:master_port
    (agent.control: {"op": "resize", "epoch", "world", "master_addr", "master_port"})."""

    op: ClassVar[str] = "resize"
    epoch: int | None = None
    world: int
    master_addr: str
    master_port: int
    standby: bool = False         # an agent that leaves stays warm for a later grow (unused by the daemon)


@message
class AgentJoin(Message):
    """Daemon -> a warm standby agent: become physical rank `rank` of `world`, joining a job that grows
    from `join_from` agents, rendezvous at master_addr:master_port (agent.process `_await_join`)."""

    op: ClassVar[str] = "join"
    rank: int
    world: int
    join_from: int
    master_addr: str
    master_port: int


@message
class AgentResized(Message):
    """Agent -> daemon: a resize finished here: {"epoch", "world", "rank", "left", "seconds"}."""

    op: ClassVar[str] = "agent_resized"
    job_id: str
    rank: int
    info: dict[str, Any] = field(default_factory=dict)
