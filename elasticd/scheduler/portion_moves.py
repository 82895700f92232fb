"""An island's side of a live move of a job spanning islands: the job grows onto another island, or shrinks
off ranks an island wants back (their node is draining).

The front decides (elasticd/federation/moves.py); an island executes its portion's part and reports it in
the portion's row, as a node does for a resize of the island's own jobs (elasticd/daemon/resizing.py):

- a drain of a node hosting agents of a portion asks the front for those ranks (the row's `leaving`)
  instead of moving the portion itself: its agents are part of a group that spans islands.
- a running portion gets `MovePortion`: the one hosting the new rank 0 has that rank's node pick the
  new group's port (`PrepareResize` with no joiner); the others have nothing to prepare.
- a joining portion (reserved with `join_from`) gets `StartPortion`: its nodes start its agents as warm
  standby joiners (`PrepareResize` with the joiners), ready once each said hello.
- `GoPortion` (every portion ready): every node of the portion gets `ResizeJob` with the new layout, its
  islands and the ranks kept; the agents re-form at their next step boundary, joiners join, leavers
  hand their workers over and exit.
- moved: every agent that stays re-formed at that epoch and completed a step after it, and every one that
  leaves has left. The portion is then the one the front asked for (its place, world, layout, islands,
  devices); one that left the job altogether is cancelled by the front.

`AbortPortionMove` calls it off (a joining portion is cancelled instead): before the go, or after it when
the agents refused the move at the step boundary (a state they cannot carry; reported as the move's error),
so they train on as they were. Any other failure after the go is undone only by the front's restart of
the whole job.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from elasticd import protocol as p
from elasticd.core.env_names import ISLANDS_VAR
from elasticd.core.failures import Cause
from elasticd.core.lifecycle import ResizeOutcome
from elasticd.core.records import ResizeEntry
from elasticd.core.timing import STALL_METRIC
from elasticd.scheduler.actions import SendToNode
from elasticd.scheduler.jobs import Job, JobState

if TYPE_CHECKING:
    from elasticd.scheduler.state import SchedulerState

log = logging.getLogger(__name__)

BUSY_S = 300.0


@dataclass(slots=True)
class PortionMove:
    spec: p.PortionSpec           # what the portion becomes (as it was, if it leaves); `spec.epoch` names it
    devices_from: int             # agents of the whole job before it
    keep: list[int]               # the old ranks that stay, in new rank order (empty: all, as they are)
    # The new group, the same on every agent, those that leave too (they hand their workers over by it).
    world: int
    blocks: list[int]
    islands: list[int]
    joining: bool = False         # this portion's agents are the joiners
    leaves: bool = False          # none of this portion's agents stays
    addr: str = ""                # the new group's rendezvous (the portion hosting its rank 0 picks it)
    port: int = 0
    ready: bool = False
    went: bool = False
    moved: bool = False
    error: str = ""
    at: float = 0.0               # when the island was told
    went_at: float = 0.0
    handover_s: float | None = None   # its lead agent's, from the vote to the new group
    stall_s: float | None = None      # its lead agent's, from its last step before to its first after
    stopped_step: int | None = None   # the step the agents stopped after
    warm: set[str] = field(default_factory=set)   # nodes whose joiners all said hello
    done: set[str] = field(default_factory=set)   # nodes whose part is done


def with_islands(env: dict[str, str], spec: p.PortionSpec) -> dict[str, str]:
    """A portion's agents' environment: the job's, and its islands when there are several (the two-level sums,
    agent/comm/islands.py; one island is no `ELASTICD_ISLANDS` at all)."""
    return {**env, ISLANDS_VAR: ",".join(map(str, spec.islands))} if len(spec.islands) > 1 else env


class PortionMoves:
    """Moves in flight, by island job id (in memory: a restarted scheduler's are called off by the front's
    deadline)."""

    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self.moves: dict[str, PortionMove] = {}
        self.preempted: dict[str, tuple[int, str]] = {}   # devices the island's policy wants back, and why

    def preempt(self, job: Job, devices: int, why: str) -> None:
        """The island's policy wants `devices` of this running portion back (a job of higher priority waits):
        asked of the front as its last ranks in the row's `leaving`."""
        if 0 < devices <= len(job.placement) and self.preempted.get(job.job_id, (0, ""))[0] != devices:
            self.preempted[job.job_id] = (devices, why)
            log.info("job %s: %d device(s) of its portion asked back from its front (%s)", job.job_id, devices, why)

    def leaving(self, job: Job) -> list[int]:
        """The ranks of a running portion its island wants back, on draining nodes or preempted: its row
        asks the front to move the job off them."""
        spec = job.spec.portion
        if spec is None or job.state is not JobState.RUNNING:
            return []
        ranks = [spec.rank_offset + k for k, (n, _d) in enumerate(job.placement) if self.state.drains.holds(n)]
        wanted = self.preempted.get(job.job_id, (0, ""))[0]
        ranks += [r for r in range(spec.rank_offset + len(job.placement) - wanted, spec.rank_offset + len(job.placement))
                  if r not in ranks]
        return sorted(ranks)

    def busy(self, now: float) -> bool:
        """A move under way: the island's policy waits for it (it changes what the island holds); not past
        BUSY_S, after which its front has called it off or restarted the job, or is gone."""
        return any(not mv.moved and not mv.error and now - mv.at < BUSY_S for mv in self.moves.values())

    def move(self, job: Job, msg: p.MovePortion, now: float) -> list[SendToNode]:
        old = job.spec.portion
        assert old is not None
        mv = self.moves.get(job.job_id)
        if mv is not None and mv.spec.epoch == msg.epoch:
            return []   # sent again
        if job.state is not JobState.RUNNING or msg.devices_from != old.world:
            log.warning("job %s: cannot move portion of %s live: it is %s, of %d agents (move from %d)", job.job_id,
                        old.span_id, job.state.value, old.world, msg.devices_from)
            return []
        spec = old if msg.index < 0 else dataclasses.replace(
            old, index=msg.index, world=msg.world, rank_offset=sum(msg.islands[:msg.index]), blocks=list(msg.blocks),
            islands=list(msg.islands))
        spec = dataclasses.replace(spec, epoch=msg.epoch)
        mv = self.moves[job.job_id] = PortionMove(spec, msg.devices_from, list(msg.keep), msg.world, list(msg.blocks),
                                                  list(msg.islands), leaves=msg.index < 0, at=now)
        what = "leaving" if mv.leaves else f"{msg.devices_from} -> {msg.world} agents"
        job.history.append([round(now, 3), job.state.value, f"moving live with job {old.span_id}: {what} "
                            f"(move {msg.epoch})"])
        self.state.dirty.add(job.job_id)
        first = msg.keep[0] if msg.keep else 0   # the old rank that is the new rank 0
        k = first - old.rank_offset
        if not 0 <= k < len(job.placement):
            mv.ready = True   # only the portion hosting the new rank 0 prepares anything (the port)
            return []
        lead = job.placement[k][0]
        mv.addr = self.state.nodes[lead].host
        return [SendToNode(lead, self._prepare(job, mv, joiners=[], pick_port=True))]

    def start_joining(self, job: Job, now: float) -> list[SendToNode]:
        """A reserved portion joining a running job: its nodes start its agents as warm joiners."""
        spec = job.spec.portion
        assert spec is not None and spec.join_from and job.state is JobState.RESERVED
        mv = self.moves[job.job_id] = PortionMove(spec, spec.join_from, [], spec.world, list(spec.blocks),
                                                  list(spec.islands), joining=True, at=now)
        job.transition(JobState.STARTING, now, f"joining job {spec.span_id} live: ranks {spec.rank_offset}-"
                       f"{spec.rank_offset + spec.devices - 1} of {spec.world} (move {spec.epoch})")
        job.launched = list(job.nodes)
        self.state.dirty.add(job.job_id)
        out = []
        for node in job.nodes:
            joiners = [p.RankPlacement(rank=spec.rank_offset + r, device_id=d)
                       for r, (n, d) in enumerate(job.placement) if n == node]
            out.append(SendToNode(node, self._prepare(job, mv, joiners, pick_port=False)))
        return out

    def _prepare(self, job: Job, mv: PortionMove, joiners: list[p.RankPlacement], pick_port: bool) -> p.PrepareResize:
        s, spec = job.spec, mv.spec
        env = with_islands(s.env, spec)
        return p.PrepareResize(job_id=job.job_id, epoch=spec.epoch, devices_from=mv.devices_from, devices=spec.world,
                               joiners=joiners, pick_port=pick_port, script=s.script, func=s.func,
                               workers=spec.workers, cwd=s.cwd, env=env, snapshot_every=s.snapshot_every,
                               blocks=list(spec.blocks), stuck_after=s.stuck_after, run_as=s.run_as,
                               threads=s.threads, device_memory=s.device_memory, snapshot_key=spec.key)

    def go(self, job: Job, msg: p.GoPortion, now: float) -> list[SendToNode]:
        mv = self.moves.get(job.job_id)
        if mv is None or mv.spec.epoch != msg.epoch or mv.went or mv.error or not job.state.active:
            return []
        mv.went, mv.went_at = True, now
        if mv.joining:
            job.master_addr, job.master_port = msg.master_addr, msg.master_port
        spec = mv.spec
        log.info("job %s: move %d of job %s goes at %s:%d", job.job_id, spec.epoch, spec.span_id, msg.master_addr,
                 msg.master_port)
        self.state.dirty.add(job.job_id)
        go = p.ResizeJob(job_id=job.job_id, devices=mv.world, epoch=spec.epoch, master_addr=msg.master_addr,
                         master_port=msg.master_port, devices_from=mv.devices_from, keep=list(mv.keep),
                         blocks=list(mv.blocks), islands=list(mv.islands))
        return [SendToNode(node, go) for node in job.nodes]

    def abort(self, job: Job, msg: p.AbortPortionMove, now: float) -> list[SendToNode]:
        mv = self.moves.get(job.job_id)
        if mv is None or mv.spec.epoch != msg.epoch or mv.moved:
            return []
        # Before the go, or after it when agents refused the move (on this island or another): their nodes
        # put back what the go changed, and send joiners still waiting away.
        del self.moves[job.job_id]
        job.history.append([round(now, 3), job.state.value, f"move {msg.epoch} called off: {msg.reason}"])
        self.state.dirty.add(job.job_id)
        return [SendToNode(node, p.AbortResize(job_id=job.job_id, epoch=msg.epoch, reason=msg.reason))
                for node in job.nodes]

    def holds_start(self, job: Job) -> bool:
        """A joining portion is not up before its joiners joined (its nodes report waiting joiners running)."""
        mv = self.moves.get(job.job_id)
        return mv is not None and mv.joining and not mv.went

    def report(self, job: Job, node: str, r: p.JobReport, now: float) -> list[SendToNode]:
        mv = self.moves.get(job.job_id)
        if mv is None or mv.moved or mv.error:
            return []
        epoch = mv.spec.epoch
        if r.resize_epoch == epoch and r.resize_error:
            mv.error = str(r.resize_error.get("message", "the move failed on " + node))[:p.MAX_TEXT_CHARS]
            self.state.dirty.add(job.job_id)
            if mv.joining:   # its joiners are gone: the portion cannot join, and the front cancels it
                return self.state.end_job(job, JobState.FAILED, now, f"joining job {mv.spec.span_id} failed: "
                                          f"{mv.error}", error={"message": mv.error, "cause": Cause.DIED.value})
            return []
        if not mv.went:
            if not mv.joining and r.resize_epoch == epoch and r.resize_port and mv.addr and not mv.port:
                mv.port, mv.ready = r.resize_port, True
            elif mv.joining:
                warm = {a.rank for a in r.agents if a.standby and a.connected and a.alive}
                if self._ranks_on(job, node) <= warm:
                    mv.warm.add(node)
                mv.ready = set(job.nodes) <= mv.warm
            return []
        for info in r.resizes:
            if info.epoch == epoch and not info.left and mv.handover_s is None:
                mv.handover_s, mv.stopped_step = round(info.seconds, 3), info.step
        kept = set(mv.keep) if mv.keep else None
        stay = [rank for rank in self._ranks_on(job, node) if kept is None or rank in kept]
        # Counted, not named: a shrink renumbers the agents that stay on their node at the go.
        staying = [a for a in r.agents if a.alive and not a.left]
        if len(staying) == len(stay) and all(a.epoch >= epoch and a.stepped >= epoch for a in staying):
            mv.done.add(node)
            stall = p.flat_metrics(r.metrics).get(STALL_METRIC)   # its lead agent's, after its first new step
            if stay and mv.stall_s is None and isinstance(stall, int | float) and not isinstance(stall, bool):
                mv.stall_s = float(stall)
        if set(job.nodes) <= mv.done:
            self._moved(job, mv, now)
        return []

    def _ranks_on(self, job: Job, node: str) -> set[int]:
        spec = job.spec.portion
        assert spec is not None
        return {spec.rank_offset + k for k, (n, _d) in enumerate(job.placement) if n == node}

    def _moved(self, job: Job, mv: PortionMove, now: float) -> None:
        old = job.spec.portion
        assert old is not None
        mv.moved = True
        self.preempted.pop(job.job_id, None)
        if mv.keep and not mv.leaves:
            # The devices of the ranks that left are free once their agents are gone (`_release`).
            kept = set(mv.keep)
            for k, (node, dev) in enumerate(job.placement):
                if old.rank_offset + k not in kept:
                    job.zombies.setdefault(node, []).append(dev)
            job.placement = [pl for k, pl in enumerate(job.placement) if old.rank_offset + k in kept]
        if not mv.leaves:
            job.spec.portion = mv.spec
            job.spec.workers = sum(mv.spec.own_blocks)
            job.blocks = list(mv.spec.own_blocks)
            self.state.changed(job, resched=True)
        what = ("its agents left the job" if mv.leaves else f"ranks {mv.spec.rank_offset}-"
                f"{mv.spec.rank_offset + mv.spec.devices - 1} of {mv.spec.world}")
        # In the job's resize history as any resize: `status` shows its times.
        job.add_resize(ResizeEntry(src=0 if mv.joining else old.devices, dst=0 if mv.leaves else mv.spec.devices,
                                   outcome=ResizeOutcome.DONE.value, at=round(mv.at, 3), epoch=mv.spec.epoch,
                                   why=f"move {mv.spec.epoch} of job {old.span_id} spanning islands: "
                                       f"{mv.devices_from} -> {mv.world} agents in all",
                                   step=mv.stopped_step, blocks=[] if mv.leaves else list(mv.spec.own_blocks),
                                   seconds=round(now - mv.at, 3), handover_s=mv.handover_s, stall=mv.stall_s,
                                   prepare_s=round(mv.went_at - mv.at, 3), done_step=job.step))
        job.history.append([round(now, 3), job.state.value, f"moved live: {what} (move {mv.spec.epoch})"])
        self.state.dirty.add(job.job_id)
        log.info("job %s: move %d of job %s done: %s", job.job_id, mv.spec.epoch, mv.spec.span_id, what)

    def ended(self, job: Job) -> None:
        self.moves.pop(job.job_id, None)
        self.preempted.pop(job.job_id, None)

    def row(self, job: Job) -> dict[str, object]:
        mv = self.moves.get(job.job_id)
        leaving = {"leaving": self.leaving(job)}
        if mv is None:
            return leaving
        return {"move_epoch": mv.spec.epoch, "move_addr": mv.addr if mv.port else "", "move_port": mv.port,
                "move_ready": mv.ready, "moved": mv.moved, "move_error": mv.error, **leaving}
