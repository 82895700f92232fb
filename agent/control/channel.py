"""The agent's channel to the node that launched it (a node daemon, or the one `elasticd run` holds in process).

The runtime only sees this interface. `NullControl` serves standalone runs (progress goes to stderr); a node
passes a ZeroMQ endpoint and the agent talks through `elasticd.agent.control.zmq_channel.ZmqControl`. Commands
arrive as the typed messages of `elasticd.protocol.agents` (`AgentStop`, `AgentResize`, `AgentJoin`).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Protocol

from elasticd import protocol as p
from elasticd.core.text import say

log = logging.getLogger(__name__)


class ControlChannel(Protocol):
    def hello(self, info: p.AgentInfo) -> None:
        """Announce the agent: it is ready to compute."""

    def step(self, step: int, metrics: dict[str, p.Scalar], timing: dict[str, int | float] | None = None,
             held: bool = False) -> None:
        """A physical step finished; `metrics` holds the last `ctx.log` values of the agent's lowest rank,
        `timing` this agent's step timing since its last report (elasticd.core.timing; {} or None: none).
        `held`: the agents stop after this step for a scheduled resize and wait for its command, which
        comes once this report is read: it goes out at once, never coalesced."""

    def done(self, stopped: bool) -> None:
        """Every hosted worker returned normally (`stopped`: unwound by a stop at a step boundary)."""

    def failed(self, error: p.AgentError) -> None:
        """A worker raised, or the agent could not load or lost its group."""

    def resized(self, info: p.ResizedInfo) -> None:
        """A resize finished on this agent."""

    def refused(self, info: p.RefusedInfo) -> None:
        """The agents refused a resize at a step boundary and train on."""

    def poll(self) -> list[p.AgentCommand]:
        """Commands waiting for the agent, never blocking: `AgentStop`, `AgentResize` or `AgentJoin`."""

    def renumber(self, physical_rank: int) -> None:
        """Speak as `physical_rank` from now on (a drain's shrink renumbered the agents that stay)."""

    def close(self) -> None: ...


class NullControl:
    """No launcher to talk to: print throttled progress from physical agent 0."""

    def __init__(self, physical_rank: int = 0, every_s: float = 2.0) -> None:
        self._print = physical_rank == 0
        self._every = every_s
        self._last = -math.inf   # the first step prints at once, however young the clock

    def hello(self, info: p.AgentInfo) -> None:
        log.debug("agent up: %s", info)

    def step(self, step: int, metrics: dict[str, p.Scalar], timing: dict[str, int | float] | None = None,
             held: bool = False) -> None:
        now = time.monotonic()
        if self._print and now - self._last >= self._every:
            self._last = now
            shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
            say(f"[elasticd] step {step} {shown}".rstrip())

    def done(self, stopped: bool) -> None:
        pass

    def failed(self, error: p.AgentError) -> None:
        pass

    def resized(self, info: p.ResizedInfo) -> None:
        pass

    def refused(self, info: p.RefusedInfo) -> None:
        pass

    def poll(self) -> list[p.AgentCommand]:
        return []

    def renumber(self, physical_rank: int) -> None:
        self._print = physical_rank == 0

    def close(self) -> None:
        pass
