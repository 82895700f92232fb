"""The node's record of its agents and of the jobs they belong to: plain data, no processes.

An `Agent` is known by its pid (unique while the daemon holds its unreaped process). A job's agents
are indexed by physical rank; `NodeJob.retired` keeps, until they are gone, agents that left in a
shrink (they exit 0 on their own, then their device is free) and joiners that were sent away;
`NodeJob.warm`, agents that left in a shrink of a job whose schedule grows again, kept as warm processes
for that grow (their devices free meanwhile). Live resize (elasticd.daemon.resizing) adds joiners:
started warm before a grow, or taken from `warm`, and counted in only once they re-formed with the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from elasticd import protocol as p
from elasticd.core.watchdog import StuckAfter, Watchdog


@dataclass(eq=False)
class Agent:
    rank: int
    device: p.DeviceInfo
    pid: int
    token: str = field(default="", repr=False)   # the secret its hello must carry (AgentHello.token)
    identity: bytes | None = None       # control-socket identity once it said hello
    exitcode: int | None = None
    rss: int = 0
    cpu: float = 0.0
    step: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    step_times: list[tuple[float, int]] = field(default_factory=list)
    # Step timings (AgentStep.timing): the latest published, numbered by `seq`, and those not yet published
    timing: dict[str, Any] = field(default_factory=dict)
    timing_seq: int = 0
    timing_acc: dict[str, Any] = field(default_factory=dict)
    # live resize
    standby: bool = False      # a joiner, warm, waiting for the hand-over
    joining: bool = False      # a joiner told to join, not yet re-formed with the others
    epoch: int = 0             # last resize epoch this agent finished
    stepped: int = 0           # last resize epoch after which it completed a step at the new size
    left: bool = False         # left the job in a shrink: exits 0, then its device is free
    warm: bool = False         # leaving (or left) in a shrink, kept for the job's coming grow (NodeJob.warm)
    dropped: bool = False      # a joiner sent away (resize called off, job ended first): exit code is no verdict
    kill_at: float | None = None   # SIGKILL deadline of a dropped joiner
    done: bool = False         # said agent_done: its workers returned and it is on its way out
    completed: int = -1        # the last step it completed, by its beat file (elasticd/core/watchdog.py)
    # Its rank before a drain's shrink renumbered it: its messages carry that rank until it re-formed.
    former_rank: int | None = None

    @property
    def pending(self) -> bool:
        """A joiner that is not part of the job's group yet."""
        return self.standby or self.joining


@dataclass(eq=False)
class NodeJob:
    job_id: str
    launch: p.LaunchJob
    master_port: int
    agents: dict[int, Agent] = field(default_factory=dict)   # by physical rank: the job's agents and joiners
    retired: list[Agent] = field(default_factory=list)      # left in a shrink or dropped joiners, until gone
    warm: list[Agent] = field(default_factory=list)         # left in a shrink, kept for a coming grow
    error: dict[str, Any] | None = None
    resizes: list[p.ResizedInfo] = field(default_factory=list)   # the lead agent's, newest last
    killing: str | None = None          # reason, once a stop/kill started
    term_at: float | None = None        # when to send SIGTERM
    kill_at: float | None = None        # when to send SIGKILL
    resize_epoch: int = 0               # the resize being prepared or carried out here
    resize_port: int = 0                # its rendezvous port (this node hosts rank 0)
    resize_error: dict[str, Any] | None = None   # a joiner died before the hand-over, or the agents refused
    # The job's agents by rank as the go of `resize_epoch` found them, to put back if the agents refuse it
    before_go: dict[int, Agent] | None = None
    restored: bool = False              # launched from a snapshot (restore_epoch) and a step completed since
    watchdog: Watchdog = field(init=False)   # its agents' beats (elasticd/core/watchdog.py), by pid
    fenced: set[int] = field(default_factory=set)   # pids the watchdog killed (why: in `error`)

    def __post_init__(self) -> None:
        self.watchdog = Watchdog(StuckAfter.parse(self.launch.stuck_after))

    def everyone(self) -> list[Agent]:
        return [*self.agents.values(), *self.retired, *self.warm]

    @property
    def state(self) -> str:
        if all(a.exitcode is not None for a in self.everyone()):
            return "ended"
        if all(a.identity is not None or a.exitcode is not None for a in self.agents.values() if not a.standby):
            return "running"
        return "launching"

    @property
    def ok(self) -> bool:
        return self.error is None and self.killing is None and all(a.exitcode == 0 for a in self.agents.values())

    def lead(self) -> Agent:
        """The agent whose progress stands for the job here: the lowest physical rank on this node."""
        return self.agents[min(self.agents)]

    def renumber(self, keep: list[int]) -> None:
        """A shrink keeping the old ranks `keep` (new rank = place in `keep`): the others are retired, and
        the stayers re-keyed all at once, so that no new rank collides with an old one still held."""
        stay: dict[int, Agent] = {}
        for rank, a in sorted(self.agents.items()):
            if a.pending:   # a warm joiner keeps the rank it was started for
                stay[rank] = a
            elif rank in keep:
                a.former_rank, a.rank = rank, keep.index(rank)
                stay[a.rank] = a
            else:
                self.retired.append(a)
        self.agents = stay

    def retire(self, agent: Agent) -> None:
        if agent in self.warm:
            self.warm.remove(agent)
            agent.warm = False
            self.retired.append(agent)
        elif self.agents.get(agent.rank) is agent:
            del self.agents[agent.rank]
            self.retired.append(agent)

    def keep_warm(self, agent: Agent) -> None:
        """A leaver of a shrink stays for the job's coming grow instead of exiting."""
        if self.agents.get(agent.rank) is agent:
            del self.agents[agent.rank]
            agent.warm = True
            self.warm.append(agent)
