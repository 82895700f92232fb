"""An island's side of a live move of a job spanning islands: its portion grows the job onto another island.

The front decides (elasticd/federation/moves.py); an island executes its portion's part and reports it in
the portion's row, as a node does for a resize of the island's own jobs (elasticd/daemon/resizing.py):

- a running portion gets `GrowPortion`: if it hosts rank 0, its rank 0's node picks the new group's port
  (`PrepareResize` with no joiner); the others have nothing to prepare.
- a joining portion (reserved with `join_from`) gets `StartPortion`: its nodes start its agents as warm
  standby joiners (`PrepareResize` with the joiners), ready once each said hello.
- `GoPortion` (every portion ready): every node of the portion gets `ResizeJob`, with the new layout and
  its islands; the running agents re-form at their next step boundary and the joiners join them.
- moved: every agent of the portion reports the epoch re-formed and a step completed after it. The
  portion is then the one the front asked for (its world, layout and islands).

`AbortPortionMove` before the go calls it off (a joining portion is cancelled instead); after the go
only the front's restart of the whole job undoes it. The agents refusing the move at the step boundary
(a state they cannot carry) is reported as the move's error; they train on as they were.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from elasticd import protocol as p
from elasticd.core.env_names import ISLANDS_VAR
from elasticd.core.failures import Cause
from elasticd.scheduler.actions import SendToNode
from elasticd.scheduler.jobs import Job, JobState

if TYPE_CHECKING:
    from elasticd.scheduler.state import SchedulerState

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PortionMove:
    spec: p.PortionSpec           # what the portion becomes; `spec.epoch` names the move
    devices_from: int             # agents of the whole job before it
    joining: bool                 # this portion's agents are the joiners
    addr: str = ""                # the new group's rendezvous (the portion hosting rank 0 picks it)
    port: int = 0
    ready: bool = False
    went: bool = False
    moved: bool = False
    error: str = ""
    warm: set[str] = field(default_factory=set)   # nodes whose joiners all said hello
    done: set[str] = field(default_factory=set)   # nodes whose agents re-formed and stepped


class PortionMoves:
    """Moves in flight, by island job id (in memory: a restarted scheduler's are called off by the front's
    deadline)."""

    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self.moves: dict[str, PortionMove] = {}

    def grow(self, job: Job, msg: p.GrowPortion, now: float) -> list[SendToNode]:
        spec = msg.portion
        mv = self.moves.get(job.job_id)
        if mv is not None and mv.spec.epoch == spec.epoch:
            return []   # sent again
        if job.state is not JobState.RUNNING:
            log.warning("job %s: cannot grow portion of %s live: it is %s", job.job_id, spec.span_id, job.state.value)
            return []
        mv = self.moves[job.job_id] = PortionMove(spec, msg.devices_from, joining=False)
        job.history.append([round(now, 3), job.state.value, f"growing live with job {spec.span_id}: "
                            f"{msg.devices_from} -> {spec.world} agents (move {spec.epoch})"])
        self.state.dirty.add(job.job_id)
        if spec.index != 0:
            mv.ready = True   # only the portion hosting rank 0 prepares anything (the port)
            return []
        lead = job.nodes[0]
        mv.addr = self.state.nodes[lead].host
        return [SendToNode(lead, self._prepare(job, mv, joiners=[], pick_port=True))]

    def start_joining(self, job: Job, now: float) -> list[SendToNode]:
        """A reserved portion joining a running job: its nodes start its agents as warm joiners."""
        spec = job.spec.portion
        assert spec is not None and spec.join_from and job.state is JobState.RESERVED
        mv = self.moves[job.job_id] = PortionMove(spec, spec.join_from, joining=True)
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
        env = dict(s.env)
        if len(spec.islands) > 1:
            env[ISLANDS_VAR] = ",".join(map(str, spec.islands))
        return p.PrepareResize(job_id=job.job_id, epoch=spec.epoch, devices_from=mv.devices_from, devices=spec.world,
                               joiners=joiners, pick_port=pick_port, script=s.script, func=s.func,
                               workers=spec.workers, cwd=s.cwd, env=env, snapshot_every=s.snapshot_every,
                               blocks=list(spec.blocks), stuck_after=s.stuck_after, run_as=s.run_as,
                               threads=s.threads, device_memory=s.device_memory, snapshot_key=spec.key)

    def go(self, job: Job, msg: p.GoPortion, now: float) -> list[SendToNode]:
        mv = self.moves.get(job.job_id)
        if mv is None or mv.spec.epoch != msg.epoch or mv.went or mv.error or not job.state.active:
            return []
        mv.went = True
        if mv.joining:
            job.master_addr, job.master_port = msg.master_addr, msg.master_port
        spec = mv.spec
        log.info("job %s: move %d of job %s goes: %d -> %d agents at %s:%d", job.job_id, spec.epoch, spec.span_id,
                 mv.devices_from, spec.world, msg.master_addr, msg.master_port)
        self.state.dirty.add(job.job_id)
        go = p.ResizeJob(job_id=job.job_id, devices=spec.world, epoch=spec.epoch, master_addr=msg.master_addr,
                         master_port=msg.master_port, devices_from=mv.devices_from, blocks=list(spec.blocks),
                         islands=list(spec.islands))
        return [SendToNode(node, go) for node in job.nodes]

    def abort(self, job: Job, msg: p.AbortPortionMove, now: float) -> list[SendToNode]:
        mv = self.moves.get(job.job_id)
        if mv is None or mv.spec.epoch != msg.epoch or (mv.went and not mv.error):
            return []   # gone ahead: only the front's restart of the whole job undoes it
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
            if not mv.joining and r.resize_epoch == epoch and r.resize_port and node == job.nodes[0]:
                mv.port, mv.ready = r.resize_port, True
            elif mv.joining:
                warm = {a.rank for a in r.agents if a.standby and a.connected and a.alive}
                mine = {mv.spec.rank_offset + k for k, (n, _d) in enumerate(job.placement) if n == node}
                if mine <= warm:
                    mv.warm.add(node)
                mv.ready = set(job.nodes) <= mv.warm
            return []
        live = [a for a in r.agents if a.alive and not a.left]
        if live and all(a.epoch >= epoch and a.stepped >= epoch for a in live):
            mv.done.add(node)
        if set(job.nodes) <= mv.done:
            mv.moved = True
            job.spec.portion = mv.spec
            job.spec.workers = sum(mv.spec.own_blocks)
            job.blocks = list(mv.spec.own_blocks)
            job.history.append([round(now, 3), job.state.value, f"moved live: ranks {mv.spec.rank_offset}-"
                                f"{mv.spec.rank_offset + mv.spec.devices - 1} of {mv.spec.world} (move {epoch})"])
            self.state.dirty.add(job.job_id)
            log.info("job %s: move %d of job %s done", job.job_id, epoch, mv.spec.span_id)
        return []

    def ended(self, job: Job) -> None:
        self.moves.pop(job.job_id, None)

    def row(self, job: Job) -> dict[str, object]:
        mv = self.moves.get(job.job_id)
        if mv is None:
            return {}
        return {"move_epoch": mv.spec.epoch, "move_addr": mv.addr if mv.port else "", "move_port": mv.port,
                "move_ready": mv.ready, "moved": mv.moved, "move_error": mv.error}
