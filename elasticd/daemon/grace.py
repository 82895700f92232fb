"""SIGTERM with a grace period: a node daemon drains itself before it exits, as spot instances allow.

A preemptible machine gets a notice (SIGTERM to its processes, seconds to minutes before it goes). A
daemon started with `--drain-grace S` answers the first SIGTERM by asking its scheduler to drain this
node with a deadline of S seconds (elasticd.scheduler.draining: the jobs shrink off it live at their
next step boundary), keeps serving meanwhile, and exits once none of its jobs' agents is left, or at
the deadline, whichever comes first; at the deadline the scheduler fails what could not move, and the
daemon stops what is left as any shutdown does. A second SIGTERM (or SIGINT, `elasticd shutdown`)
exits at once. With no grace (the default) SIGTERM stops the agents at once, as before. The request is
repeated whenever the scheduler welcomes the node again (a restarted scheduler forgets drains). A
daemon running the island's embedded scheduler takes it along when it exits: drain such a node only
when the island goes with it, or run a standalone scheduler.

`GraceDrain` decides; the daemon's loop (elasticd.daemon.server) sends and stops. The clock is passed in.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


class GraceDrain:
    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.deadline: float | None = None   # set by the first SIGTERM
        self.asked = False                   # the drain request went to the scheduler
        self.drained = False                 # the scheduler said so (in its heartbeat acks)

    def terminate(self, now: float) -> bool:
        """A SIGTERM: True to exit at once (no grace, or the second one), else drain until the deadline."""
        if self.grace_s <= 0 or self.deadline is not None:
            return True
        self.deadline = now + self.grace_s
        return False

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def must_ask(self, connected: bool) -> bool:
        """Whether to send the drain request now (once, as soon as the scheduler link is up)."""
        if self.deadline is None or self.asked or not connected:
            return False
        self.asked = True
        return True

    def done(self, now: float, live_agents: int, connected: bool) -> bool:
        """Time to exit: the scheduler says the node is drained (`drained`: no job counts on this node
        any more; an agent that left may exit before its job's move is complete, and a node that goes
        then would fail the job) and no agent is left, or the grace period is over. Without a scheduler
        to ask (`connected` False), no agent left is enough."""
        if self.deadline is None:
            return False
        if live_agents == 0 and (self.drained or not connected):
            log.info("drained: no agent left; exiting")
            return True
        if now >= self.deadline:
            log.warning("grace period of %.0fs over with %d agents still running; stopping them", self.grace_s,
                        live_agents)
            return True
        return False

    def left(self, now: float) -> float:
        return 0.0 if self.deadline is None else max(0.0, self.deadline - now)
