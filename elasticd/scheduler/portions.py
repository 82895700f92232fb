"""An island's portions of jobs spanning islands: what its federation front asks, as jobs of the island.

`ReservePortion` queues the portion as a job of this island (its share of the logical workers, on exactly
its number of devices, in the layout the front cut): the policy places it like any job, and then holds
its devices without launching (`reserved`, elasticd.scheduler.state `_start`). `StartPortion` launches
it; its agents are ranks of the whole job (`SchedulerState.launch`) and meet the other islands' agents at
portion 0's rendezvous. `CancelPortion` releases the reservation, or stops the agents. Every command is
idempotent, keyed by (job at the front, attempt): the front sends one again when the island's rows do not
show it yet.

A portion never restarts on its own (its island's agents are one part of a process group that spans
islands) and is not resized by its island; a failure ends it, and the front ends the job's other portions.
The front may grow the job onto another island live (elasticd.scheduler.portion_moves).

Commands come only from the front this scheduler joined: they arrive on its own connection to that
front (elasticd.scheduler.federation_link), never on the sockets clients and nodes use.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from elasticd import protocol as p
from elasticd.core.errors import ControlPlaneError
from elasticd.scheduler.actions import SendToNode
from elasticd.scheduler.jobs import Job, JobState
from elasticd.scheduler.portion_moves import PortionMoves

if TYPE_CHECKING:   # annotations only: state.py holds a `Portions`
    from elasticd.scheduler.state import SchedulerState

log = logging.getLogger(__name__)

MAX_REFUSED = 256   # refusals kept to report (the front needs to see one only once)
MAX_ROWS = 1024     # portions reported, newest first


class Portions:
    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self._refused: dict[tuple[str, int, int], p.PortionRow] = {}
        self.moves = PortionMoves(state)

    def apply(self, msg: p.Message, now: float) -> list[SendToNode]:
        if isinstance(msg, p.ReservePortion):
            return self.reserve(msg, now)
        if isinstance(msg, p.StartPortion):
            return self.start(msg, now)
        if isinstance(msg, p.CancelPortion):
            return self.cancel(msg, now)
        if isinstance(msg, p.MovePortion):
            job = self.find(msg.span_id, msg.attempt)
            return [] if job is None else self.moves.move(job, msg, now)
        if isinstance(msg, p.GoPortion):
            job = self.find(msg.span_id, msg.attempt)
            return [] if job is None else self.moves.go(job, msg, now)
        if isinstance(msg, p.AbortPortionMove):
            job = self.find(msg.span_id, msg.attempt)
            return [] if job is None else self.moves.abort(job, msg, now)
        log.warning("federation front sent %s, which an island scheduler does not take from it", msg.op)
        return []

    def reserve(self, msg: p.ReservePortion, now: float) -> list[SendToNode]:
        spec = msg.portion
        key = (spec.span_id, spec.attempt, spec.epoch)
        if self.find(spec.span_id, spec.attempt, spec.epoch) is not None or key in self._refused:
            return []
        blocks = spec.own_blocks
        req = p.Submit(script=msg.script, func=msg.func, workers=sum(blocks), min_devices=spec.devices,
                       max_devices=spec.devices, priority=msg.priority, name=msg.name, cwd=msg.cwd, env=dict(msg.env),
                       snapshot_every=msg.snapshot_every, max_restarts=0, threads=msg.threads, blocks=list(blocks))
        try:
            job, out = self.state.submit(req, now, owner=msg.owner, portion=spec)
        except ControlPlaneError as e:   # the scheduler's refusal of what it was asked (SchedulerError)
            why = str(e)
            log.warning("portion %d of job %s refused: %s", spec.index, spec.span_id, why)
            self._refused[key] = p.PortionRow(span_id=spec.span_id, attempt=spec.attempt, index=spec.index,
                                              job_id="", state=JobState.FAILED.value, error=why)
            while len(self._refused) > MAX_REFUSED:
                del self._refused[next(iter(self._refused))]
            return []
        log.info("job %s: portion %d of job %s spanning islands (%d devices, ranks %d-%d of %d)", job.job_id,
                 spec.index, spec.span_id, spec.devices, spec.rank_offset, spec.rank_offset + spec.devices - 1,
                 spec.world)
        return out

    def start(self, msg: p.StartPortion, now: float) -> list[SendToNode]:
        job = self.find(msg.span_id, msg.attempt)
        if job is None or job.state is not JobState.RESERVED:
            return []   # started already (a command sent again), or gone
        if job.spec.portion is not None and job.spec.portion.join_from:
            return self.moves.start_joining(job, now)
        return self.state.start_portion(job, msg.master_addr, msg.master_port, now)

    def cancel(self, msg: p.CancelPortion, now: float) -> list[SendToNode]:
        for key in [k for k in self._refused if k[:2] == (msg.span_id, msg.attempt)]:
            del self._refused[key]
        job = self.find(msg.span_id, msg.attempt)
        if job is None or job.state.terminal:
            return []
        log.info("job %s: portion of %s cancelled by its federation front: %s", job.job_id, msg.span_id, msg.reason)
        return self.state.end_job(job, JobState.STOPPED, now, msg.reason or "cancelled by its federation front")

    def find(self, span_id: str, attempt: int, join_epoch: int | None = None) -> Job | None:
        """The island's job of this attempt of a spanning job: one not ended first, then the newest (a portion
        that joined it live is of the same attempt; `join_epoch`: only the one that joined at that move)."""
        found = [j for j in self.state.jobs.values() if (s := j.spec.portion) is not None and s.span_id == span_id
                 and s.attempt == attempt and (join_epoch is None or s.join_from and s.epoch == join_epoch
                                               or not join_epoch and not s.join_from)]
        return max(found, key=lambda j: (not j.state.terminal, j.seq), default=None)

    def rows(self) -> list[p.PortionRow]:
        """One row per attempt of a spanning job, the job `find` names: an island joining live again after a
        move was called off holds a new job for the portion that was cancelled."""
        jobs = sorted((j for j in self.state.jobs.values() if j.spec.portion is not None),
                      key=lambda j: (j.state.terminal, -j.seq))
        seen: set[tuple[str, int]] = set()
        rows = []
        for job in jobs:
            spec = job.spec.portion
            assert spec is not None
            if job.state.terminal:
                self.moves.ended(job)
            if (spec.span_id, spec.attempt) not in seen and len(rows) < MAX_ROWS:
                seen.add((spec.span_id, spec.attempt))
                rows.append(self._row(job))
        return rows + list(self._refused.values())

    def _row(self, job: Job) -> p.PortionRow:
        spec = job.spec.portion
        assert spec is not None
        lead = spec.index == 0 and bool(job.master_port)
        return p.PortionRow(span_id=spec.span_id, attempt=spec.attempt, index=spec.index, job_id=job.job_id,
                            state=job.state.value, step=job.step, steps_per_s=job.steps_per_s,
                            master_addr=job.master_addr if lead else "", master_port=job.master_port if lead else 0,
                            error=str((job.error or {}).get("message", ""))[:p.MAX_TEXT_CHARS],
                            cause=str((job.error or {}).get("cause", ""))[:32], **self.moves.row(job))
