"""The island scheduler's core: the job table and node table as a synchronous state machine.

Stimuli (requests from clients, hellos and heartbeats from nodes, clock ticks) go in; what comes out
is a list of `SendToNode` actions (messages for nodes) and the set of jobs to persist. No sockets, threads
or clocks in here: `now` is always passed in, so tests drive time by hand (as torch elastic's
rendezvous tests do with a fake clock).

Reconciliation is by full state: every node heartbeat carries the node's view of all its jobs, and
the scheduler answers a disagreement (a stray or stopped job still running there) with a repeated
`KillJob`. Lost messages, a restarted scheduler or a restarted daemon are all repaired that way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from elasticd import protocol as p
from elasticd.core.cadence import Every
from elasticd.core.env_names import RESTARTS_VAR, STEP_OFFSET_VAR
from elasticd.core.errors import ControlPlaneError
from elasticd.core.failures import Cause
from elasticd.core.lifecycle import ResizeOutcome, ResizePhase
from elasticd.core.timing import STALL_METRIC
from elasticd.core.watchdog import StuckAfter
from elasticd.placement import policy
from elasticd.placement.speeds import Speeds
from elasticd.protocol.limits import bad_scale_at
from elasticd.scheduler.actions import SendToNode
from elasticd.scheduler.draining import Drains
from elasticd.scheduler.events import NodeEvents, select
from elasticd.scheduler.jobs import Job, JobSpec, JobState
from elasticd.scheduler.portion_moves import with_islands
from elasticd.scheduler.portions import Portions
from elasticd.scheduler.recovery import Recoveries, infrastructure
from elasticd.scheduler.resizing import Resizes, refused_at
from elasticd.scheduler.scheduled import ScheduledScales

log = logging.getLogger(__name__)


class SchedulerError(ControlPlaneError):
    """A request the scheduler refuses; `code` is a protocol error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


__all__ = ["Config", "Node", "SchedulerError", "SchedulerState", "SendToNode"]


@dataclass(slots=True)
class Node:
    node_id: str
    host: str = ""
    devices: list[str] = field(default_factory=list)
    last_seen: float = 0.0
    alive: bool = True
    known: bool = False   # said hello since this scheduler started (else a placeholder from the table)


@dataclass(slots=True)
class Config:
    heartbeat_s: float = 1.0
    node_timeout_s: float = 10.0
    start_timeout_s: float = 300.0
    kill_repeat_s: float = 2.0
    resize_enabled: bool = True   # False: `scale` of a running job is only recorded (applies when next placed)
    resize_timeout_s: float = 120.0   # per resize phase: joiners warm, then every agent re-formed
    relayout_enabled: bool = True   # live re-layouts when measured device speeds drift


class SchedulerState:
    """The job and node tables; live resizes are `self.resizes`'s (elasticd.scheduler.resizing), which
    sees this class only as a `ResizeHost` (elasticd.scheduler.host)."""

    def __init__(self, jobs: list[Job] | None = None, *, now: float, config: Config | None = None,
                 speeds: Speeds | None = None) -> None:
        self.cfg = config or Config()
        self.speeds = speeds or Speeds()   # device speeds and the re-layout gate (elasticd.placement.speeds)
        self.jobs: dict[str, Job] = {}
        self.nodes: dict[str, Node] = {}
        self.dirty: set[str] = set()
        self._kill_sent: dict[tuple[str, str], float] = {}
        self._next_seq = 1
        # Placement is deterministic given the tables, so it only reruns after something that can
        # change its answer (a submit, a node joining or leaving, devices freed); heartbeats that
        # change nothing stay cheap with hundreds of nodes.
        self._resched = True
        self.resizes = Resizes(self)
        self.recoveries = Recoveries(self)
        self.drains = Drains(self)   # nodes being emptied before they go (elasticd.scheduler.draining)
        self.scheduled = ScheduledScales(self, self.resizes, self.free_count, self.queued)   # --scale-at
        self.node_events = NodeEvents()   # joins, losses, drains: `elasticd events` (jobs keep their own)
        self.portions = Portions(self)    # portions of jobs spanning islands, from the federation front
        for job in sorted(jobs or [], key=lambda j: j.seq):
            self.jobs[job.job_id] = job
            self._next_seq = max(self._next_seq, job.seq + 1)
            # Nodes of jobs that were running before a restart are presumed alive until they
            # either say hello or stay silent for a node timeout.
            for node_id in list(job.nodes if job.state.active else []) + list(job.zombies):
                self.nodes.setdefault(node_id, Node(node_id, last_seen=now))

    # --- client requests -------------------------------------------------------------------------

    def submit(self, req: p.Submit, now: float, owner: str = "", run_as: str = "",
               portion: p.PortionSpec | None = None) -> tuple[Job, list[SendToNode]]:
        """Queue a job; it may start right away (`portion`: one island's part of a job spanning islands, held
        once placed until the front starts it: elasticd.scheduler.portions).

        Raises:
            SchedulerError: `bad_request` for sizes that describe no valid job.
        """
        n = req.workers
        hi = req.max_devices or n
        if n < 1 or n > 65536:
            raise SchedulerError(p.BAD_REQUEST, f"--workers must be between 1 and 65536, got {n}")
        if not 1 <= req.min_devices <= hi <= n:
            raise SchedulerError(p.BAD_REQUEST, "need 1 <= --min-devices <= --max-devices <= --workers, got "
                                 f"{req.min_devices} <= {hi} <= {n}")
        if not req.script:
            raise SchedulerError(p.BAD_REQUEST, "script path is empty")
        try:
            every = str(Every.parse(req.snapshot_every))
        except ValueError as e:
            raise SchedulerError(p.BAD_REQUEST, f"--snapshot-every: {e}") from None
        try:
            stuck_after = str(StuckAfter.parse(req.stuck_after))
        except ValueError as e:
            raise SchedulerError(p.BAD_REQUEST, str(e)) from None
        if (why := bad_scale_at([(e.step, e.devices) for e in req.scale_at], n)
                or next((f"after step {e.step}: {w}" for e in req.scale_at
                         if (w := p.bad_blocks(e.blocks, e.devices, n))), None)):
            raise SchedulerError(p.BAD_REQUEST, f"--scale-at: {why}")
        if req.blocks and ((why := p.bad_blocks(req.blocks, len(req.blocks), n))
                           or not req.min_devices == len(req.blocks) == hi):
            raise SchedulerError(p.BAD_REQUEST, "--layout: " + (why or f"a layout of {len(req.blocks)} devices runs "
                                                                f"on {len(req.blocks)} devices, not {req.min_devices}"
                                                                f"..{hi}"))
        if not 0 <= req.max_restarts <= 10_000:
            raise SchedulerError(p.BAD_REQUEST, f"--max-restarts must be between 0 and 10000, got {req.max_restarts}")
        seq = self._next_seq
        self._next_seq += 1
        spec = JobSpec(script=req.script, func=req.func, workers=n, min_devices=req.min_devices,
                       max_devices=hi, priority=req.priority, name=req.name[:128], cwd=req.cwd,
                       env=dict(req.env), snapshot_every=every, max_restarts=req.max_restarts,
                       owner=owner, torchrun=req.torchrun, stuck_after=stuck_after, run_as=run_as,
                       scale_at=list(req.scale_at), threads=req.threads, device_memory=req.device_memory,
                       blocks=list(req.blocks), portion=portion)
        job = Job(job_id=f"j{seq}", seq=seq, spec=spec, submitted_at=now, state_since=now,
                  history=[[round(now, 3), JobState.QUEUED.value, "submitted"]])
        self.jobs[job.job_id] = job
        self.dirty.add(job.job_id)
        self._resched = True
        log.info("job %s submitted: %s workers=%d devices=%d..%d priority=%d",
                 job.job_id, spec.script, n, spec.min_devices, hi, spec.priority)
        return job, self._schedule(now)

    def stop(self, job_id: str, now: float) -> tuple[str, list[SendToNode]]:
        job = self._job(job_id)
        if job.state.terminal:
            return f"job {job_id} already {job.state.value}", []
        out = self.end_job(job, JobState.STOPPED, now, "stopped by user")
        return f"job {job_id} stopped", out + self._schedule(now)

    def scale(self, job_id: str, devices: int, now: float) -> tuple[str, list[SendToNode]]:
        job = self._job(job_id)
        if job.spec.portion is not None:
            raise SchedulerError(p.INVALID_STATE, f"job {job_id} is a portion of job {job.spec.portion.span_id} "
                                 "spanning islands: such a job runs at the size its federation front gave it")
        n = job.spec.workers
        if not 1 <= devices <= n:
            raise SchedulerError(p.BAD_REQUEST, f"job {job_id} has {n} workers: --devices must be in 1..{n}, "
                                 f"got {devices}")
        if job.state.terminal:
            raise SchedulerError(p.INVALID_STATE, f"job {job_id} is {job.state.value}")
        if job.state is JobState.QUEUED:
            job.requested_devices = devices
            self.dirty.add(job_id)
            self._resched = True
            return f"job {job_id} will start on {devices} devices", self._schedule(now)
        if job.state is JobState.RESIZING and job.resize is not None:
            plan = job.resize
            what = (f"preparing its scheduled grow {plan.src} -> {plan.dst} devices ({plan.why}, after step "
                    f"{plan.after_step})" if plan.ahead else f"resizing {plan.src} -> {plan.dst} devices")
            raise SchedulerError(p.INVALID_STATE, f"job {job_id} is {what} (one resize at a time); scale it again "
                                 "once it is running")
        if job.state is not JobState.RUNNING:
            raise SchedulerError(p.INVALID_STATE, f"job {job_id} is {job.state.value}; scale it once it is running")
        current = len(job.placement)
        if devices == current:
            job.requested_devices = devices   # the user's word: the policy leaves this size alone
            self.dirty.add(job_id)
            return f"job {job_id} already runs on {devices} devices; nothing to do", []
        if not self.cfg.resize_enabled:
            job.requested_devices = devices
            self.dirty.add(job_id)
            return (f"job {job_id}: scale to {devices} devices recorded; live resize is off, so it applies "
                    "when the job is next placed"), []
        free = self.free_count()
        if devices - current > free:
            leaving = sum(len(d) for d in job.zombies.values())
            hint = (f"; {leaving} more will be free once the agents that left it in its last resize have exited "
                    "(a second or two)" if leaving else "")
            raise SchedulerError(p.INVALID_STATE, f"job {job_id} cannot grow from {current} to {devices} devices: "
                                 f"{free} free (at most {current + free} now){hint}")
        job.requested_devices = devices
        out = self.resizes.begin(job, devices, "scale command", now)
        if job.spec.torchrun:
            return (f"job {job_id} restarting on {devices} devices (torchrun mode: every agent stops and the script "
                    f"starts again, from its own checkpoint if it loads one)"), out
        caveat = "" if job.entered_steps else (
            "; it has not reached a `ctx.steps` step boundary yet: a job that never does cannot be resized, and "
            "then this resize is recorded as refused when it ends")
        return (f"job {job_id} resizing {current} -> {devices} devices at its next step boundary "
                f"(epoch {job.epoch}){caveat}"), out

    def drain(self, node_id: str, deadline_s: float | None, now: float) -> tuple[str, list[SendToNode]]:
        """Move every job off `node_id` and give it no new work (elasticd.scheduler.draining).

        Raises:
            SchedulerError: `unknown_node` for a node this scheduler does not know, `bad_request` for a
                negative deadline.
        """
        try:
            text, out = self.drains.drain(node_id, deadline_s, now)
        except LookupError as e:
            raise SchedulerError(p.UNKNOWN_NODE, str(e)) from None
        except ValueError as e:
            raise SchedulerError(p.BAD_REQUEST, str(e)) from None
        return text, out + self._schedule(now)

    def undrain(self, node_id: str, now: float) -> tuple[str, list[SendToNode]]:
        """Put a draining node back into service.

        Raises:
            SchedulerError: `invalid_state` if the node is not draining.
        """
        try:
            text = self.drains.undrain(node_id, now)
        except LookupError as e:
            raise SchedulerError(p.INVALID_STATE, str(e)) from None
        self.node_events.add(now, "node_undrained", node_id, text)
        return text, self._schedule(now)

    def status(self, job_id: str | None, now: float) -> p.StatusReply:
        if job_id is not None:
            # One job's view (what `submit --wait` polls) lists only its own nodes: cheap on a big island.
            jobs = [self._job(job_id)]
            shown = set(jobs[0].nodes)
        else:
            jobs = sorted(self.jobs.values(), key=lambda j: j.seq)
            shown = set(self.nodes)
        return p.StatusReply(jobs=[self._info(j) for j in jobs], nodes=self.node_infos(now, shown))

    def events(self, job_id: str | None, after: float, owner: str | None = None) -> p.EventsReply:
        """`elasticd events`: one job's events, or the island's (only `owner`'s jobs unless None).

        Raises:
            SchedulerError: `unknown_job` for a job not in the table.
        """
        if job_id is not None:
            evs, more = select([self._job(job_id)], None, after)
        else:
            jobs = [j for j in self.jobs.values() if owner is None or j.spec.owner == owner]
            evs, more = select(jobs, self.node_events, after)
        return p.EventsReply(events=evs, more=more)

    def node_infos(self, now: float, shown: set[str] | None = None) -> list[p.NodeInfo]:
        busy = self._busy()
        names = sorted(self.nodes if shown is None else shown)
        return [p.NodeInfo(node_id=nd.node_id, host=nd.host, alive=nd.alive, devices=list(nd.devices),
                           free=[d for d in nd.devices if (nd.node_id, d) not in busy],
                           last_seen_s=round(max(0.0, now - nd.last_seen), 3),
                           draining=self.drains.info(nd.node_id, now),
                           speeds={d: round(self.speeds.speed(nd.node_id, d), 3) for d in nd.devices})
                for nd in (self.nodes[n] for n in names if n in self.nodes) if nd.known]

    def job_infos(self, after: int = 0):
        """(seq, status row) of every job submitted after `after`, in submission order (a paged list)."""
        for job in sorted((j for j in self.jobs.values() if j.seq > after), key=lambda j: j.seq):
            yield job.seq, self._info(job)

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def bump_seq(self, floor: int) -> None:
        """Never hand out a job id below `floor` (ids of purged jobs are not reused)."""
        self._next_seq = max(self._next_seq, floor)

    def purge(self, job_ids: list[str]) -> list[str]:
        """Forget ended jobs (retention); returns those removed. Active jobs are never purged."""
        gone = [j for j in job_ids if j in self.jobs and self.jobs[j].state.terminal]
        for job_id in gone:
            del self.jobs[job_id]
            self.dirty.discard(job_id)
            for key in [k for k in self._kill_sent if k[1] == job_id]:
                del self._kill_sent[key]
        return gone

    # --- node stimuli ----------------------------------------------------------------------------

    def node_hello(self, hello: p.NodeHello, now: float) -> list[SendToNode]:
        nd = self.nodes.get(hello.node_id)
        rejoin = nd is not None and nd.known
        nd = nd or Node(hello.node_id)
        self.nodes[hello.node_id] = nd
        nd.host, nd.devices = hello.host, [d.device_id for d in hello.devices]
        self.speeds.declare(nd.node_id, hello.devices)
        nd.last_seen, nd.alive, nd.known = now, True, True
        self._resched = True
        self.node_events.add(now, "node_rejoined" if rejoin else "node_joined", hello.node_id,
                             f"host {hello.host}, devices {','.join(nd.devices) or '-'}")
        log.info("node %s %s: host=%s devices=%s jobs=%s", hello.node_id, "rejoined" if rejoin else "joined",
                 hello.host, ",".join(nd.devices), [r.job_id for r in hello.jobs])
        out: list[SendToNode] = [SendToNode(nd.node_id, p.Welcome(node_id=nd.node_id, heartbeat_s=self.cfg.heartbeat_s))]
        reported = {r.job_id for r in hello.jobs}
        # A hello means the daemon may be new: agents it should run but does not report are gone.
        for job in list(self.jobs.values()):
            if job.state.active and nd.node_id in job.launched and job.job_id not in reported:
                out += self._lost(job, nd.node_id, now, f"agents on node {nd.node_id} vanished (daemon restarted?)")
            if nd.node_id in job.zombies and job.job_id not in reported:
                self._unzombie(job, nd.node_id)
        out += self._reports(nd.node_id, hello.jobs, now)[0]
        return out + self._schedule(now)

    def node_status(self, st: p.NodeStatus, now: float) -> list[SendToNode]:
        """A heartbeat.

        Raises:
            SchedulerError: `unknown_node` if the node has not said hello to this scheduler.
        """
        nd = self.nodes.get(st.node_id)
        if nd is None or not nd.known or not nd.alive:
            raise SchedulerError(p.UNKNOWN_NODE, f"node {st.node_id} must say hello first")
        nd.last_seen = now
        out, forget = self._reports(st.node_id, st.jobs, now)
        drain = self.drains.info(st.node_id, now)
        drained = drain is not None and drain.drained
        out.append(SendToNode(st.node_id, p.NodeAck(seq=st.seq, forget=forget, drained=drained)))
        return out + self._schedule(now)

    def node_bye(self, node_id: str, now: float) -> list[SendToNode]:
        nd = self.nodes.get(node_id)
        if nd is None or not nd.alive:
            return []
        log.info("node %s left", node_id)
        return self._node_lost(nd, now, f"node {node_id} shut down", "node_left") + self._schedule(now)

    def tick(self, now: float) -> list[SendToNode]:
        out: list[SendToNode] = []
        for nd in list(self.nodes.values()):
            if nd.alive and now - nd.last_seen > self.cfg.node_timeout_s:
                log.warning("node %s lost: no heartbeat for %.1fs", nd.node_id, now - nd.last_seen)
                out += self._node_lost(nd, now, f"node {nd.node_id} lost (no heartbeat for "
                                       f"{now - nd.last_seen:.0f}s)")
        for job in list(self.jobs.values()):
            if job.state is JobState.STARTING and now - job.state_since > self.cfg.start_timeout_s:
                out += self.end_job(job, JobState.FAILED, now, "agents did not start within "
                                    f"{self.cfg.start_timeout_s:.0f}s",
                                    error={"message": f"agents did not start within {self.cfg.start_timeout_s:.0f}s"})
            elif job.state is JobState.RESERVED and now - job.state_since > self.cfg.start_timeout_s:
                why = f"its federation front did not start it within {self.cfg.start_timeout_s:.0f}s of its reservation"
                out += self.end_job(job, JobState.FAILED, now, why, error={"message": why})
        if self.speeds.expire(now):
            self._resched = True
        out += self.resizes.tick(now)
        for job in list(self.jobs.values()):
            out += self.scheduled.due(job, now)   # a scheduled resize that waited for one in flight
        out += self.drains.tick(now)
        out += self._relayouts(now)
        return out + self._schedule(now)

    def take_dirty(self) -> list[Job]:
        jobs = [self.jobs[j] for j in sorted(self.dirty) if j in self.jobs]
        self.dirty.clear()
        return jobs

    def validate(self) -> None:
        """Invariants (for tests): no device is given to two active jobs; placements fit the bounds."""
        seen: dict[tuple[str, str], str] = {}
        for job in self.jobs.values():
            if job.state.active:
                m = len(job.placement)
                assert 1 <= m <= job.spec.workers, (job.job_id, m)
                assert job.state is JobState.RECOVERING or p.bad_blocks(job.blocks, m, job.spec.workers) is None, \
                    (job.job_id, job.blocks, m)
                held = {(n, d) for n, d in job.placement}
                if job.resize is not None:
                    assert job.state is JobState.RESIZING, job.job_id
                    kept = [job.placement[k] for k in job.resize.stayers]
                    assert job.resize.placement[:len(kept)] == kept, job.job_id
                    held |= {(n, d) for n, d in job.resize.placement}
                for node, dev in held:
                    assert (node, dev) not in seen, f"{node}/{dev} held by {seen[(node, dev)]} and {job.job_id}"
                    seen[(node, dev)] = job.job_id
            else:
                assert job.resize is None, job.job_id
            if job.state is JobState.QUEUED:
                assert not job.placement and not job.launched, job.job_id

    # --- internals -------------------------------------------------------------------------------

    def _job(self, job_id: str) -> Job:
        job = self.jobs.get(job_id)
        if job is None:
            raise SchedulerError(p.UNKNOWN_JOB, f"no job {job_id!r}")
        return job

    def _busy(self) -> set[tuple[str, str]]:
        busy: set[tuple[str, str]] = set()
        for job in self.jobs.values():
            if job.state.active:
                busy.update((n, d) for n, d in job.placement)
                if job.resize is not None:   # devices reserved for joining ranks
                    busy.update((n, d) for n, d in job.resize.placement)
            for node, devs in job.zombies.items():
                busy.update((node, d) for d in devs)
        return busy

    def changed(self, job: Job, *, resched: bool = False) -> None:
        """`job`'s row changed (persist it); `resched`: devices were freed or reserved."""
        self.dirty.add(job.job_id)
        if resched:
            self._resched = True

    def reschedule(self) -> None:
        """Run the placement again at the next chance (the devices on offer changed)."""
        self._resched = True

    def free_count(self) -> int:
        return sum(len(v.free) for v in self.free_views())

    def free_views(self) -> list[policy.NodeView]:
        """Live nodes with their free devices, for the policy."""
        busy = self._busy()
        load: dict[str, int] = {}
        for node, _dev in busy:
            load[node] = load.get(node, 0) + 1
        return [policy.NodeView(nd.node_id, tuple(d for d in nd.devices if (nd.node_id, d) not in busy),
                                load.get(nd.node_id, 0), len(nd.devices))
                for nd in sorted(self.nodes.values(), key=lambda x: x.node_id)
                if nd.alive and nd.known and not self.drains.holds(nd.node_id)]

    def queued(self) -> list[Job]:
        return [j for j in self.jobs.values() if j.state is JobState.QUEUED]

    def _schedule(self, now: float) -> list[SendToNode]:
        if not self._resched:
            return []
        self._resched = False
        queued = self.queued()
        reqs = [policy.JobRequest(j.job_id, j.spec.workers, j.spec.min_devices, j.spec.max_devices,
                                  j.spec.priority, j.seq, j.requested_devices) for j in queued]
        out: list[SendToNode] = []
        if queued:
            # A grow prepared ahead of its step holds its devices only because nothing else wanted them: a
            # waiting job is placed (and the policy preempts for it) as if the grow had not been prepared,
            # which then happens at its step if the devices are free there.
            for j in self.jobs.values():
                if j.grow_ahead:
                    out += self.resizes.call_off_ahead(j, now, f"job {queued[0].job_id} is waiting for devices")
        started = policy.place(reqs, self.free_views(), self.speeds.costs) if queued else {}
        for job_id, chosen in started.items():
            out += self._start(self.jobs[job_id], chosen, now)
        return out + self._rebalance([r for r in reqs if r.job_id not in started], now)

    def _rebalance(self, waiting: list[policy.JobRequest], now: float) -> list[SendToNode]:
        """Policy-driven live resizes (policy rules 5 and 6), one wave at a time: nothing is decided while
        a resize is in flight or devices are still being freed, so decisions see the settled island."""
        if not waiting:
            self.portions.moves.preempted.clear()   # nothing waits for what was asked back any more
        if not self.cfg.resize_enabled:
            return []
        if any(j.resize is not None or (j.zombies and j.state.active) or self.recoveries.restarting(j)
               for j in self.jobs.values()) or self.portions.moves.busy(now):
            return []
        # A portion of a job spanning islands may be preempted (its front moves the job off the ranks asked
        # for, elasticd.scheduler.portion_moves), every device of it; it never grows here.
        running = [policy.RunningJob(j.job_id, j.spec.workers, len(j.placement),
                                     0 if j.spec.portion is not None else j.spec.min_devices,
                                     len(j.placement) if j.spec.portion is not None else j.spec.max_devices,
                                     j.spec.priority, j.seq, tuple((n, d) for n, d in j.placement))
                   for j in self.jobs.values() if j.state is JobState.RUNNING and j.requested_devices is None
                   and (j.spec.min_devices < j.spec.max_devices or j.spec.portion is not None)
                   and not any(self.drains.holds(n) for n in j.nodes)]   # a drain is moving those
        if not running:
            return []
        out: list[SendToNode] = []
        for d in policy.rebalance(waiting, running, self.free_views(), self.speeds.costs):
            job = self.jobs[d.job_id]
            if job.spec.portion is not None:
                self.portions.moves.preempt(job, len(job.placement) - d.devices, d.why)
                continue
            if d.devices > len(job.placement) and d.devices - len(job.placement) > self.free_count():
                continue   # an earlier grow of this wave took the devices (cannot happen with one node view)
            out += self.resizes.begin(job, d.devices, d.why, now)
        return out

    def _relayouts(self, now: float) -> list[SendToNode]:
        """Live re-layouts of running jobs whose devices' measured speeds drifted (elasticd.placement.speeds):
        same devices, other block sizes, through the resize path. Not while the job may be resized for
        another reason (a drain holds its node, devices of its last resize are still being freed)."""
        if not (self.cfg.resize_enabled and self.cfg.relayout_enabled):
            return []
        out: list[SendToNode] = []
        for job in sorted(self.jobs.values(), key=lambda j: j.seq):
            if (job.state is not JobState.RUNNING or job.resize is not None or job.zombies
                    or len(job.placement) < 2 or not job.entered_steps or job.layout_pinned
                    or any(self.drains.holds(n) for n in job.nodes)
                    or job.resizes and job.resizes[-1].outcome == ResizeOutcome.REFUSED):   # its agents would again
                continue
            rl = self.speeds.relayout(job.job_id, job.spec.workers, job.placement, job.blocks, now)
            if rl is None:
                continue
            log.info("job %s re-layout: %s (predicted %.4fs -> %.4fs, gain %.0f%%)", job.job_id, rl.reason,
                     rl.current_s, rl.predicted_s, 100 * rl.gain)
            try:
                out += self.resizes.begin_relayout(job, rl, now)
            except ValueError as e:
                log.warning("job %s: re-layout refused: %s", job.job_id, e)
                continue
            self.speeds.done(job.job_id, now)
        return out

    def _start(self, job: Job, chosen: list[tuple[str, str]], now: float) -> list[SendToNode]:
        job.placement = [[n, d] for n, d in chosen]
        if job.layout_pinned and job.blocks and len(job.blocks) == len(chosen):
            pass   # the user's layout (--scale-at's blocks) on a restart at the same size
        elif job.spec.blocks and len(job.spec.blocks) == len(chosen):
            job.blocks, job.layout_pinned = list(job.spec.blocks), True   # --layout
        else:
            job.blocks, job.layout_pinned = self.speeds.blocks_for(job.job_id, job.spec.workers, job.placement), False
        job.relayout = None
        job.launched, job.ready, job.ended = [], [], []
        job.master_addr, job.master_port = self.nodes[chosen[0][0]].host, 0
        job.step, job.steps_per_s, job.metrics, job.error, job.agents = 0, 0.0, {}, None, {}
        job.restore_epoch = 0
        if job.spec.portion is not None:
            job.transition(JobState.RESERVED, now, f"holding {len(chosen)} devices of {','.join(job.nodes)} for "
                           f"job {job.spec.portion.span_id} until every island holds its portion")
            self.dirty.add(job.job_id)
            return []
        job.transition(JobState.STARTING, now, f"placed on {len(chosen)} devices of {','.join(job.nodes)}")
        self.dirty.add(job.job_id)
        log.info("job %s starting: %d workers on %d devices %s%s", job.job_id, job.spec.workers, len(chosen),
                 " ".join(f"{n}/{d}" for n, d in chosen), f" blocks {job.blocks}" if job.blocks else "")
        # Rank 0's node goes first: it picks the rendezvous port, which the other nodes need.
        return [self.launch(job, job.nodes[0])]

    def start_portion(self, job: Job, master_addr: str, master_port: int, now: float) -> list[SendToNode]:
        """The front started this reserved portion: portion 0 launches its rank 0's node first (which picks
        the rendezvous port, as `_start` does); the others launch every node with portion 0's rendezvous."""
        portion = job.spec.portion
        assert portion is not None and job.state is JobState.RESERVED
        job.transition(JobState.STARTING, now, f"started by its federation front (ranks {portion.rank_offset}-"
                       f"{portion.rank_offset + portion.devices - 1} of {portion.world})"
                       + (", from the job's newest complete snapshot" if portion.restore else ""))
        job.restore_latest = portion.restore
        self.dirty.add(job.job_id)
        if portion.index == 0:
            return [self.launch(job, job.nodes[0])]
        job.master_addr, job.master_port = master_addr, master_port
        return [self.launch(job, node) for node in job.nodes]

    def launch(self, job: Job, node: str) -> SendToNode:
        job.launched.append(node)
        job.held = None   # new agents: none is held
        self.dirty.add(job.job_id)
        if p.bad_blocks(job.blocks, len(job.placement), job.spec.workers) is not None:
            # A restart on fewer devices (recovery, a fall-back) keeps no stale layout: placed afresh.
            job.blocks, job.layout_pinned = self.speeds.blocks_for(job.job_id, job.spec.workers, job.placement), False
        # A portion's agents are ranks of the whole job spanning islands, in its layout and process group.
        portion = job.spec.portion
        offset = portion.rank_offset if portion is not None else 0
        env = self._env(job) if portion is None else with_islands(self._env(job), portion)
        return SendToNode(node, p.LaunchJob(
            job_id=job.job_id, script=job.spec.script, func=job.spec.func,
            workers=portion.workers if portion is not None else job.spec.workers,
            devices=portion.world if portion is not None else len(job.placement),
            placements=[p.RankPlacement(rank=offset + r, device_id=d) for r, (n, d) in enumerate(job.placement)
                        if n == node],
            master_addr=job.master_addr, master_port=job.master_port, cwd=job.spec.cwd, env=env,
            restore_epoch=job.restore_epoch, restore_latest=job.restore_latest,
            snapshot_every=job.spec.snapshot_every, incarnation=job.incarnation,
            blocks=list(portion.blocks if portion is not None else job.blocks),
            stuck_after=job.spec.stuck_after, run_as=job.spec.run_as, hold_at=job.hold_at,
            threads=job.spec.threads, device_memory=job.spec.device_memory,
            snapshot_key=portion.key if portion is not None else ""))

    @staticmethod
    def _env(job: Job) -> dict[str, str]:
        """The agents' environment: the job's, and after a restart its count, which a torchrun script reads
        as TORCHELASTIC_RESTART_COUNT (agent/compat/worker_env.py), as torchrun's restarted workers do; a
        torchrun-mode job's agents also count its steps on from where it was."""
        if not job.incarnation:
            return job.spec.env
        env = {**job.spec.env, RESTARTS_VAR: str(job.incarnation)}
        if job.spec.torchrun:
            env[STEP_OFFSET_VAR] = str(job.step_offset)
        return env

    def _reports(self, node: str, reports: list[p.JobReport], now: float) -> tuple[list[SendToNode], list[str]]:
        out: list[SendToNode] = []
        forget: list[str] = []
        for r in reports:
            job = self.jobs.get(r.job_id)
            if (job is not None and job.restore_epoch and r.restore_epoch != job.restore_epoch
                    and job.state.active and node in job.nodes):
                # The job's agents before it fell back to a snapshot: gone, and their node keeps the
                # snapshot for the restart (a forget would delete it).
                continue
            if (job is not None and r.incarnation != job.incarnation and job.state.active
                    and node in job.launched):
                # Agents from before a recovery's restart (a heartbeat sent before the node got the new
                # launch): gone, and likewise their node keeps the snapshots the restart restores.
                continue
            if job is not None and node in job.launched:   # also after the job ended: agents still exiting
                job.agents[node] = [p.AgentRow(rank=a.rank, node=node, device=a.device_id, pid=a.pid,
                                               alive=a.alive, rss=a.rss, cpu=a.cpu, exitcode=a.exitcode,
                                               timing=dict(a.timing))
                                    for a in r.agents]
                if job.state is JobState.RUNNING:
                    self.speeds.observe(job.job_id, len(job.placement), node, r.agents, now)
            if job is None or not (job.state.active and node in job.launched):
                if r.state == "ended":
                    if job is not None:
                        self._unzombie(job, node)
                    forget.append(r.job_id)
                    self._kill_sent.pop((node, r.job_id), None)
                else:
                    out += self.kill(node, r.job_id, now, "not scheduled here")
                continue
            self._release(job, node, r)
            if self.resizes.rollbacks.rolling_back(job):
                out += self.resizes.rollbacks.report(job, node, r, now)
                continue
            if self.recoveries.recovering(job):
                out += self.recoveries.report(job, node, r, now)
                if job.state.terminal:
                    forget.append(job.job_id)
                continue
            out += self.resizes.report(job, node, r, now)
            if job.spec.portion is not None:
                out += self.portions.moves.report(job, node, r, now)
            self._release(job, node, r)   # a resize this report completed: its leavers may be gone already
            if not (job.state.active and node in job.launched):   # the report ended the job, or the node's part
                continue
            if r.state == "ended":
                left = self.resizes.node_ended(job, node, r, now)
                out += left if left is not None else self._ended(job, node, r, now)
                if job.state.terminal:
                    forget.append(job.job_id)
                continue
            if r.master_port and not job.master_port and node == job.nodes[0]:
                job.master_port = r.master_port
                self.dirty.add(job.job_id)
                out += [self.launch(job, other) for other in job.nodes[1:]]
            if r.state == "running" and node not in job.ready and not self.portions.moves.holds_start(job):
                job.ready.append(node)
                self.dirty.add(job.job_id)
                if job.state is JobState.STARTING and set(job.ready) == set(job.nodes):
                    job.transition(JobState.RUNNING, now, "all agents up")
                    log.info("job %s running", job.job_id)
            if node == job.nodes[0]:
                self._progress(job, r)
                if job.recovery is not None:
                    self.recoveries.stepped(job, r, now)
                out += self.scheduled.due(job, now, refused_at(r))
        return out, forget

    @staticmethod
    def _progress(job: Job, r: p.JobReport) -> None:
        """Rank 0's node reports the job's step, rate and metrics; the periodic snapshot's are set apart. A
        node whose agents all left the job (a portion moved off its island) names no rank and says nothing."""
        if not r.ranks:
            return
        metrics = p.flat_metrics(r.metrics)
        snapshot = {k.removeprefix("snapshot_"): metrics.pop(k) for k in list(metrics) if k.startswith("snapshot_")}
        metrics.pop("resumed_from", None)
        metrics.pop(STALL_METRIC, None)
        job.step, job.steps_per_s, job.metrics = r.step, r.steps_per_s, metrics
        if snapshot and snapshot != job.snapshot:
            job.snapshot = snapshot

    def _ended(self, job: Job, node: str, r: p.JobReport, now: float) -> list[SendToNode]:
        if node in job.ended:
            return []
        if node == job.nodes[0]:
            self._progress(job, r)
        if not r.ok:
            err = dict(p.flat_scalars(r.error or {}))
            err.setdefault("message", "agent failed")
            err["node"] = node
            err = self.resizes.name_error(job, err)
            log.warning("job %s failed on node %s: %s", job.job_id, node, err.get("message"))
            if job.resize is not None and job.resize.phase == ResizePhase.GO:
                return self.resizes.agent_failed(job, now, err, joiner=False, gone=node)
            if infrastructure(err):
                recovered = self.recover(job, now, err, gone=node, completed=_completed(r))
                if recovered is not None:
                    return recovered
                err["message"] = self.recoveries.restart_refusal(job, err)
            return self.end_job(job, JobState.FAILED, now, f"agent failed on {node}", error=err, gone=node)
        job.ended.append(node)
        self.dirty.add(job.job_id)
        out: list[SendToNode] = []
        if set(job.nodes) <= set(job.ended):
            out += self.resizes.close(job, now, "finished")
            for other in job.launched:   # nodes holding only joiners of a resize that never happened
                if other not in job.ended:
                    devs = job.zombies.setdefault(other, [])
                    devs += [d for n, d in job.placement if n == other and d not in devs]
                    out += self.kill(other, job.job_id, now, "job finished", force=True)
            if job.state is JobState.STARTING:
                job.transition(JobState.RUNNING, now, "all agents up")
            job.transition(JobState.FINISHED, now, "all agents exited 0")
            self.speeds.forget_job(job.job_id)
            self._resched = True
            log.info("job %s finished at step %d", job.job_id, job.step)
        return out

    def _release(self, job: Job, node: str, r: p.JobReport) -> None:
        """Free devices of an active job's departed agents (ranks that left, dropped joiners) as soon as
        the node no longer reports a live agent on them."""
        devs = job.zombies.get(node)
        if not devs:
            return
        alive = {a.device_id for a in r.agents if a.alive and not a.warm}   # a warm leaver holds no device
        keep = [d for d in devs if d in alive]
        if len(keep) == len(devs):
            return
        if keep:
            job.zombies[node] = keep
        else:
            del job.zombies[node]
        self.dirty.add(job.job_id)
        self._resched = True

    def end_job(self, job: Job, dst: JobState, now: float, reason: str, *, error: dict[str, Any] | None = None,
                gone: str | None = None) -> list[SendToNode]:
        """Leave an active (or queued) state for `dst`; kill agents wherever they may still run."""
        out: list[SendToNode] = []
        if job.resize is not None:
            out += self.resizes.close(job, now, dst.value)
        if self.recoveries.restarting(job):   # a torchrun-mode restart at a new size ends with the job
            self.recoveries.close_restart(job, ResizeOutcome.FAILED if dst is JobState.FAILED
                                          else ResizeOutcome.NOT_APPLIED, reason)
        if job.state.active:
            for node in job.launched:
                if node == gone or node in job.ended:
                    continue
                devs = job.zombies.setdefault(node, [])
                devs += [d for n, d in job.placement if n == node and d not in devs]
                out += self.kill(node, job.job_id, now, reason, force=True)
        if gone is not None:
            job.zombies.pop(gone, None)   # everything of the job there has exited (or the node is gone)
        job.transition(dst, now, reason)
        self._resched = True
        if dst.terminal:
            self.speeds.forget_job(job.job_id)
        if error is not None:
            job.error = error
        self.dirty.add(job.job_id)
        return out

    def _lost(self, job: Job, node: str, now: float, reason: str) -> list[SendToNode]:
        """Agents of an active job are gone on `node`: a start is retried, a running job fails (a resize
        that only started joiners there is called off)."""
        plan = job.resize
        if plan is not None and plan.phase == ResizePhase.PREPARE and node not in job.nodes:
            job.zombies.pop(node, None)
            if node in job.launched:
                job.launched.remove(node)
            return self.resizes.agent_failed(job, now, {"message": reason}, joiner=True)
        if self.resizes.rollbacks.lost(job, node):   # it hosted only joiners: the others hold the snapshot
            if self.resizes.rollbacks.rolling_back(job):
                return self.resizes.rollbacks.settle(job, now)
            return self.resizes.agent_failed(job, now, {"message": reason, "node": node}, joiner=True)
        if self.recoveries.recovering(job):
            return self.recoveries.lost(job, node, now)
        # A start is retried here, but not a portion's: its agents were meeting other islands' at a rendezvous
        # that will not wait for a retry, so it fails, and the front restarts the whole job.
        if job.state is JobState.RESERVED or (job.state is JobState.STARTING and not job.restore_epoch
                                              and job.spec.portion is None):
            out = self.end_job(job, JobState.QUEUED, now, reason + "; requeued", gone=node)
            job.placement, job.launched, job.ready, job.ended = [], [], [], []
            return out
        err = {"message": reason, "node": node, "cause": Cause.NODE_LOST.value}
        if job.resize is None or job.resize.phase != ResizePhase.ROLLBACK:
            recovered = self.recover(job, now, err, gone=node)
            if recovered is not None:
                return recovered
            err["message"] = self.recoveries.restart_refusal(job, err)
        return self.end_job(job, JobState.FAILED, now, reason, error=err, gone=node)

    def takes_work(self, node: str) -> bool:
        return not self.drains.holds(node)

    def recover(self, job: Job, now: float, err: dict[str, Any], gone: str | None = None, completed: int = -1
                ) -> list[SendToNode] | None:
        """Restart the job from its newest snapshot after an infrastructure failure (None: no restarts left).
        `completed`: the last step an agent of the reporting node completed, by its beat file."""
        if not self.recoveries.restarts_left(job):
            return None
        out = self.resizes.close(job, now, "failed")   # a resize in flight is off: the restart decides the size
        return out + self.recoveries.begin(job, now, err, gone=gone, completed=completed)

    def _node_lost(self, nd: Node, now: float, reason: str, event: str = "node_lost") -> list[SendToNode]:
        nd.alive = False
        self.node_events.add(now, event, nd.node_id, reason)
        self._resched = True
        out: list[SendToNode] = []
        for job in list(self.jobs.values()):
            job.zombies.pop(nd.node_id, None)
            involved = nd.node_id in job.nodes or (job.resize is not None and nd.node_id in job.resize.nodes())
            if job.state.active and involved:
                out += self._lost(job, nd.node_id, now, reason)
            self.dirty.add(job.job_id)
        return out

    def _unzombie(self, job: Job, node: str) -> None:
        if job.zombies.pop(node, None) is not None:
            self.dirty.add(job.job_id)
            self._resched = True

    def kill(self, node: str, job_id: str, now: float, reason: str, force: bool = False,
             hard: bool = False) -> list[SendToNode]:
        """`force`: send now even if a kill went there a moment ago; `hard`: no stop command first."""
        last = self._kill_sent.get((node, job_id))
        if not force and last is not None and now - last < self.cfg.kill_repeat_s:
            return []
        self._kill_sent[(node, job_id)] = now
        return [SendToNode(node, p.KillJob(job_id=job_id, reason=reason, force=hard))]

    @staticmethod
    def _resizing_info(job: Job) -> p.ResizeInFlight | None:
        plan = job.resize
        if plan is None:
            return None
        saved = {part for parts in plan.saved.values() for part in parts}
        return p.ResizeInFlight(epoch=plan.epoch, src=plan.src, dst=plan.dst, why=plan.why, phase=plan.phase.value,
                                at=round(plan.requested_at, 3), saved=len(saved), parts=job.spec.workers + 1)

    def _info(self, job: Job) -> p.JobInfo:
        return p.JobInfo(
            job_id=job.job_id, name=job.spec.name, state=job.state.value, workers=job.spec.workers,
            devices=len(job.placement) if (job.state.active or job.state.terminal) else 0,
            min_devices=job.spec.min_devices, max_devices=job.spec.max_devices, priority=job.spec.priority,
            nodes=job.nodes, step=job.step, steps_per_s=job.steps_per_s, metrics=dict(job.metrics),
            script=job.spec.script, submitted_at=job.submitted_at, started_at=job.started_at,
            ended_at=job.ended_at, error=p.flat_scalars(job.error) if job.error else None,
            requested_devices=job.requested_devices,
            resizes=list(job.resizes), resizing=self._resizing_info(job),
            history=[(float(at), str(state), str(reason)) for at, state, reason in job.history],
            recoveries=list(job.recoveries), snapshot=dict(job.snapshot) or None, blocks=list(job.blocks),
            layout=(self.speeds.job_layout(job.job_id, job.spec.workers, job.placement, job.blocks, job.steps_per_s)
                    if job.state.active else None),
            agents=sorted((a for agents in job.agents.values() for a in agents), key=lambda a: a.rank),
            run_as=job.spec.run_as,
            scale_at=list(job.spec.scale_at[job.scheduled:]),
            portion_of=_portion_of(job.spec.portion))


def _completed(r: p.JobReport) -> int:
    """The last step an agent of a node's report completed, by its beat file (-1: none)."""
    return max((a.completed for a in r.agents), default=-1)


def _portion_of(portion: p.PortionSpec | None) -> str:
    """How `status` names the job spanning islands a portion belongs to ("" for an island's own job)."""
    if portion is None:
        return ""
    last = portion.rank_offset + portion.devices - 1
    return (f"{portion.span_id} (portion {portion.index + 1} of {len(portion.islands)}: ranks {portion.rank_offset}-"
            f"{last} of {portion.world}, {sum(portion.own_blocks)} of its {portion.workers} workers)")
