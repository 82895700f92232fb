"""Draining a node before it goes (a preemption notice, maintenance): move its jobs off it live.

`elasticd drain NODE [--deadline S]` (or SIGTERM to a node daemon started with `--drain-grace S`) marks
the node draining. From then on:

- it takes no new work: the placement policy and grows no longer see its free devices;
- every running job with agents on it is resized off it at its next step boundary, live, with nothing
  redone: a shrink that keeps the job's agents on other nodes, whatever ranks they hold (the node may
  host physical rank 0: the stayers are renumbered, `Resizes.begin_keeping`). When too few of the job's
  devices are elsewhere (`--min-devices`), the job first grows onto free devices of other nodes (an
  ordinary live grow), then shrinks off the node. A job still starting there (nothing computed yet) is
  moved by letting it finish starting, then shrinking it like the others;
- the node is *drained* once no agent of an active job runs there: the daemon may go.

A job whose agents refuse its move (a state they cannot carry across a resize, agent/slicer/boundary.py)
keeps running there, not asked again; `status` says why it waits, and the deadline treats it as a job
that could not move.

At the deadline, a job that could not move off (not enough devices elsewhere, or its move still in
flight) is recovered as after a lost node (elasticd.scheduler.recovery): its agents are stopped and it
restarts from its newest periodic snapshot on its devices elsewhere, or waits in the queue for enough
of them, the draining node excluded; with no restarts left (`--max-restarts`) it fails, with an error
naming the drain and what it lacked. Nothing is lost silently. Without a deadline such a job keeps running there until it
ends or devices free up elsewhere. `elasticd undrain NODE` puts the node back into service; moves
already done stay done (the policy grows jobs back into free devices as usual). A node that leaves
(its daemon exits, or it is lost) ends its drain: a daemon started there again is back in service.

A drain lives in the scheduler's memory, not in its job table: a restarted scheduler forgets it.

`Drains` is pure like the state that holds it (elasticd.scheduler.state): `now` comes in, sends go out.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elasticd.core.failures import Cause
from elasticd.core.lifecycle import ResizeOutcome
from elasticd.protocol.status import DrainInfo
from elasticd.scheduler.actions import SendToNode
from elasticd.scheduler.jobs import Job, JobState

if TYPE_CHECKING:   # annotations only: state.py holds a `Drains` and is what it works on
    from elasticd.scheduler.state import SchedulerState

log = logging.getLogger(__name__)


@dataclass(slots=True)
class NodeDrain:
    node_id: str
    since: float
    deadline: float                   # math.inf: none
    drained_at: float | None = None   # when the last agent of an active job there was gone
    waiting: str = ""                 # why a job cannot move off yet (shown in status)

    def info(self, now: float) -> DrainInfo:
        left = None if math.isinf(self.deadline) else round(max(0.0, self.deadline - now), 3)
        return DrainInfo(since=round(self.since, 3), deadline_s=left, drained=self.drained_at is not None,
                           seconds=round((self.drained_at or now) - self.since, 3), waiting=self.waiting)


class Drains:
    """The island's draining nodes and the moves that empty them."""

    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self.nodes: dict[str, NodeDrain] = {}

    def holds(self, node_id: str) -> bool:
        """The node takes no new work."""
        return node_id in self.nodes

    def info(self, node_id: str, now: float) -> DrainInfo | None:
        d = self.nodes.get(node_id)
        return None if d is None else d.info(now)

    # --- requests --------------------------------------------------------------------------------

    def drain(self, node_id: str, deadline_s: float | None, now: float) -> tuple[str, list[SendToNode]]:
        """Start draining `node_id` (again: a new deadline replaces the old one).

        Raises:
            LookupError: no such node is known to the scheduler.
            ValueError: a negative deadline.
        """
        nd = self.state.nodes.get(node_id)
        if nd is None or not nd.known or not nd.alive:
            known = ", ".join(sorted(n for n, x in self.state.nodes.items() if x.known and x.alive)) or "none"
            raise LookupError(f"no node {node_id!r} is up (up: {known})")
        if deadline_s is not None and deadline_s < 0:
            raise ValueError(f"--deadline must be >= 0 seconds, got {deadline_s}")
        deadline = math.inf if deadline_s is None else now + deadline_s
        d = self.nodes.get(node_id)
        if d is None:
            d = self.nodes[node_id] = NodeDrain(node_id, since=now, deadline=deadline)
        else:
            d.deadline = deadline
        self.state.reschedule()   # its free devices are no longer offered
        jobs = self._jobs_on(node_id)
        log.info("node %s draining (deadline %s): jobs %s", node_id,
                 "none" if deadline_s is None else f"{deadline_s:.0f}s", [j.job_id for j in jobs])
        self.state.node_events.add(now, "node_draining", node_id, "deadline " + (
            "none" if deadline_s is None else f"{deadline_s:g}s") + f", jobs there: {len(jobs)}")
        out = self.tick(now)
        when = "" if deadline_s is None else f" within {deadline_s:g}s"
        what = (f"moving {len(jobs)} job(s) off it{when}: {', '.join(j.job_id for j in jobs)}" if jobs
                else "no job runs there")
        return f"node {node_id} draining: it takes no new work; {what}", out

    def undrain(self, node_id: str, now: float) -> str:
        """Put a draining node back into service.

        Raises:
            LookupError: the node is not draining.
        """
        d = self.nodes.pop(node_id, None)
        if d is None:
            raise LookupError(f"node {node_id!r} is not draining")
        self.state.reschedule()   # its free devices are offered again
        log.info("node %s back in service after %.1fs of draining", node_id, now - d.since)
        return f"node {node_id} back in service: it takes new work again"

    # --- the clock -------------------------------------------------------------------------------

    def tick(self, now: float) -> list[SendToNode]:
        """Move what can move off the draining nodes; fail what is still there at its node's deadline."""
        out: list[SendToNode] = []
        for d in list(self.nodes.values()):
            nd = self.state.nodes.get(d.node_id)
            if nd is None or not nd.alive:
                # Gone (its daemon said bye once drained, or it was lost): the drain is over, and what
                # was left there is the node-loss path's business. A daemon started there again is back
                # in service.
                del self.nodes[d.node_id]
                log.info("node %s left while draining (%s)", d.node_id,
                         "drained" if d.drained_at is not None else "not drained")
                continue
            waiting = []
            for job in self._jobs_on(d.node_id):
                if now >= d.deadline:
                    out += self._fail(job, d, now)
                    continue
                why = self._move(job, d, now, out)
                if why:
                    waiting.append(f"{job.job_id}: {why}")
            if "; ".join(waiting) != d.waiting:
                d.waiting = "; ".join(waiting)
                if waiting:
                    log.warning("node %s draining, cannot move yet: %s", d.node_id, d.waiting)
            busy = self._jobs_on(d.node_id) or any(d.node_id in j.zombies for j in self.state.jobs.values())
            if not busy and d.drained_at is None:
                d.drained_at = now
                d.waiting = ""
                log.info("node %s drained in %.2fs", d.node_id, now - d.since)
                self.state.node_events.add(now, "node_drained", d.node_id, f"drained in {now - d.since:.2f}s")
            elif busy:
                d.drained_at = None
        return out

    # --- internals -------------------------------------------------------------------------------

    def _jobs_on(self, node_id: str) -> list[Job]:
        """Active jobs with agents on the node, or about to have (a resize's joiners)."""
        return sorted((j for j in self.state.jobs.values() if j.state.active and (
            node_id in j.nodes or (j.resize is not None and node_id in j.resize.nodes()))), key=lambda j: j.seq)

    def _plan(self, job: Job) -> tuple[list[int] | None, int, str]:
        """How `job` (running, no resize in flight) gets off the draining nodes: (old ranks to keep, None
        to grow first), devices to grow to (0: none), or why it cannot move now."""
        drained = set(self.nodes)
        stayers = [i for i, (n, _dev) in enumerate(job.placement) if n not in drained]
        need = max(1, job.spec.min_devices)
        if len(stayers) >= need:
            return stayers, 0, ""
        m, room, free = len(job.placement), job.spec.workers - len(job.placement), self.state.free_count()
        grow = min(free, room)
        if grow > 0 and len(stayers) + grow >= need:
            return None, m + grow, ""
        if room < need - len(stayers):
            return None, 0, (f"it runs on {m} devices, {len(stayers)} off the node, and needs {need} there "
                             f"(--min-devices {need}) but has {job.spec.workers} workers: no room to grow onto "
                             "other nodes first")
        return None, 0, (f"it needs {need - len(stayers)} more device(s) off the node (--min-devices {need}), "
                         f"{free} free")

    def _move(self, job: Job, d: NodeDrain, now: float, out: list[SendToNode]) -> str:
        """Start moving `job` off the node if it can move now; the reason it waits otherwise ("" if moving)."""
        if job.grow_ahead:
            # A scheduled grow waiting for its step would hold the move for up to PREPARE_AHEAD_S: it is
            # called off, and happens at its step wherever the job is then.
            out += self.state.resizes.call_off_ahead(job, now, f"drain of node {d.node_id}")
        if job.spec.portion is not None:
            if job.state is not JobState.RUNNING:
                return ""
            # Its agents are part of a group that spans islands: the front moves the whole job off them (the
            # portion's row names its ranks on draining nodes, elasticd.scheduler.portion_moves).
            return (f"a portion of job {job.spec.portion.span_id} spanning islands: waiting for its federation "
                    "front to move that job off the node")
        if job.state is not JobState.RUNNING or job.resize is not None:
            return ""   # starting, or a resize in flight: looked at again once it runs
        what = f"drain of node {d.node_id}"
        last = job.resizes[-1] if job.resizes else None
        if last is not None and last.outcome == ResizeOutcome.REFUSED and last.why.startswith(what):
            # Its agents cannot carry its state: asking again would only cost it a capture per attempt.
            return f"its agents refused to move it: {last.note}"
        keep, grow, why = self._plan(job)
        if keep is not None:
            log.info("job %s: moving off draining node %s, keeping old ranks %s", job.job_id, d.node_id, keep)
            out += self.state.resizes.begin_keeping(job, keep, what, now)
        elif grow:
            # Onto other nodes first (the new ranks land there: draining nodes offer no devices); once it
            # runs there, the next tick shrinks it off the draining node.
            log.info("job %s: growing %d -> %d devices before leaving draining node %s", job.job_id,
                     len(job.placement), grow, d.node_id)
            out += self.state.resizes.begin(job, grow, f"{what}: growing onto other nodes first", now)
        return why

    def _fail(self, job: Job, d: NodeDrain, now: float) -> list[SendToNode]:
        if job.resize is not None:
            why = f"its move ({job.resize.why}, {job.resize.src} -> {job.resize.dst} devices) was still in flight"
        elif job.state is JobState.RUNNING:
            why = self._plan(job)[2] or "it had not started moving yet"
        else:
            why = f"it was still {job.state.value}"
        msg = (f"node {d.node_id} was drained and its deadline passed after {now - d.since:.0f}s before the job "
               f"could move off it: {why}")
        log.warning("job %s: %s", job.job_id, msg)
        err = {"message": msg, "node": d.node_id, "drain": True, "cause": Cause.DRAINED.value}
        recovered = self.state.recover(job, now, err)
        if recovered is not None:
            return recovered
        err["message"] = self.state.recoveries.restart_refusal(job, err)
        return self.state.end_job(job, JobState.FAILED, now, f"drain of node {d.node_id}: deadline passed",
                                  error=err)
