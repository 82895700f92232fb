"""Live resize, the scheduler's shell: place the new layout, talk to the nodes, keep the job table.

What to do and when (who moves, when to go, when it is done, abort or roll back) is decided by the job's
`ResizePlan` (elasticd.resize_plan), the same decisions `elasticd run` executes on one machine; this
module turns node reports into the plan's events and its actions into node messages and job-table
changes. `Resizes` is an object `SchedulerState` holds, seeing the state only as a `ResizeHost`
(elasticd.scheduler.host); the fall-back half is `elasticd.scheduler.rollback.Rollbacks`.

One resize of a running job from M to M2 devices (layout epoch E):

1. `Resizes.begin` picks the new layout -- ranks 0..min(M, M2)-1 keep their devices (agents that stay
   keep their process), a grow adds devices for ranks M..M2-1 -- and sends `PrepareResize` to the node
   hosting rank 0, which picks the new group's rendezvous port, and to every node getting a joining
   rank, which starts its joiners as warm standby agents. The job keeps training meanwhile: starting a
   process and importing torch takes seconds, the hand-over itself a fraction of one.
2. Once the port is known and every joiner has said hello (both arrive in node heartbeats, pushed at
   once), `ResizeJob` goes to every node of the old and new layout. The agents stop together at the
   next step boundary, hand their state over point to point and re-form the group.
3. The resize is done when every rank of the new layout reported `resized` for E and rank 0 completed
   a step at the new size. The new layout becomes the job's placement; the devices of ranks that left
   are freed as their nodes report those agents gone (they exit 0 after the hand-over).

Failures. A joiner that dies, or does not come up within `resize_timeout_s`, during step 1 aborts the
resize and the job goes on at M: nothing was touched yet. After step 2 an agent that dies while the
group re-forms, or a resize that does not finish within `resize_timeout_s`, rolls the resize back: every
agent is stopped and the job restarts on its M devices from the snapshot saved at the step boundary
(elasticd.scheduler.rollback). Only when that snapshot is incomplete does the job fail, with an error
naming the resize; it never hangs nor retries forever.
"""

from __future__ import annotations

import logging
from typing import Any

from elasticd import protocol as p
from elasticd.core.lifecycle import ResizeOutcome, ResizePhase
from elasticd.core.timing import STALL_METRIC
from elasticd.placement import policy, speeds
from elasticd.placement.speeds import Relayout
from elasticd.resize_plan import Abort, Action, Done, Fail, Go, Refuse, ResizePlan, RollBack
from elasticd.scheduler.actions import SendToNode
from elasticd.scheduler.host import ResizeHost
from elasticd.scheduler.jobs import Job, JobState
from elasticd.scheduler.recovery import Recoveries
from elasticd.scheduler.rollback import Rollbacks

log = logging.getLogger(__name__)

# Why a release of agents held for a scheduled resize that did not happen begins: "release after step S".
RELEASE_WHY = "release after step "


class Resizes:
    """The scheduler's resizes in flight: one `ResizePlan` per resizing job (kept in `Job.resize`)."""

    def __init__(self, host: ResizeHost) -> None:
        self.host = host
        self.rollbacks = Rollbacks(host)
        self.restarts = Recoveries(host)   # stateless: a torchrun-mode resize is a restart at the new size

    # --- starting ------------------------------------------------------------------------------------

    def begin(self, job: Job, dst: int, why: str, now: float, blocks: list[int] | None = None,
              after_step: int = -1) -> list[SendToNode]:
        """Start moving a running job to `dst` devices (phase 1); `blocks`: the new layout's block sizes, the
        user's (the job is then left alone by the speed-aware re-layout), else the cost model's;
        `after_step` >= 0: a scheduled grow prepared ahead, whose go waits for the job at that step.

        Raises:
            ValueError: a grow needs more devices than are free (callers check `SchedulerState.free_count`).
        """
        assert job.state is JobState.RUNNING and job.resize is None, (job.job_id, job.state)
        src = len(job.placement)
        if dst > src:
            chosen = policy.spread(dst - src, self.host.free_views(), self.host.speeds.costs, job.job_id)
            placement = [list(x) for x in job.placement] + [[n, d] for n, d in chosen]
        else:
            placement = [list(x) for x in job.placement[:dst]]
        job.layout_pinned = blocks is not None
        if blocks is None:
            blocks = self.host.speeds.blocks_for(job.job_id, job.spec.workers, placement)
        return self._begin(job, placement, None, why, now, blocks, after_step=after_step)

    def reached(self, job: Job, now: float) -> list[SendToNode]:
        """The job is at the step its resize was prepared ahead of: go once the joiners are warm."""
        plan = job.resize
        assert plan is not None
        job.held = plan.after_step   # its agents hold there: released if the resize does not happen now
        self.host.changed(job)
        return self._act(job, now, plan.reached(job.step, now))

    def call_off_ahead(self, job: Job, now: float, reason: str) -> list[SendToNode]:
        """Call off a grow prepared ahead whose step the job has not reached (a drain must move the job now):
        its joiners go, and the entry is handled at its step."""
        assert job.resize is not None and job.resize.ahead, job.job_id
        return self._call_off(job, now, reason, ResizeOutcome.ABORTED)

    def begin_keeping(self, job: Job, keep: list[int], why: str, now: float) -> list[SendToNode]:
        """Shrink a running job onto the devices of its old ranks `keep`, which become ranks 0..len-1 in
        that order (a drain moving the job off a node, whichever ranks the node hosts).

        Raises:
            ValueError: `keep` names no shrink of the job's layout.
        """
        assert job.state is JobState.RUNNING and job.resize is None, (job.job_id, job.state)
        placement = [list(job.placement[k]) for k in keep]
        job.layout_pinned = False
        blocks = self.host.speeds.blocks_for(job.job_id, job.spec.workers, placement)
        return self._begin(job, placement, keep, why, now, blocks)

    def begin_relayout(self, job: Job, rl: Relayout, now: float) -> list[SendToNode]:
        """Move a running job to other block sizes on the devices it has (a live re-layout): the same
        resize path with no joiner and no leaver, so workers move between its agents at a step boundary.

        Raises:
            ValueError: the plan refuses it (the blocks are the job's already).
        """
        assert job.state is JobState.RUNNING and job.resize is None, (job.job_id, job.state)
        m = len(job.placement)
        job.relayout = {"reason": rl.reason, "predicted_gain": rl.gain,
                        "blocks_from": speeds.sizes(job.blocks, job.spec.workers, m),
                        "blocks_to": speeds.sizes(rl.blocks, job.spec.workers, m),
                        "predicted_s": round(rl.predicted_s, 6), "predicted_from_s": round(rl.current_s, 6)}
        try:
            return self._begin(job, [list(x) for x in job.placement], None, "re-layout", now, list(rl.blocks))
        except ValueError:
            job.relayout = None
            raise

    def begin_release(self, job: Job, step: int, now: float) -> list[SendToNode]:
        """Let the agents held after `step` for a scheduled resize that did not happen go on: a resize to
        the layout they have, so nothing moves (elasticd.scheduler.scheduled)."""
        assert job.state is JobState.RUNNING and job.resize is None, (job.job_id, job.state)
        return self._begin(job, [list(x) for x in job.placement], None, f"{RELEASE_WHY}{step}", now,
                           list(job.blocks), release=True)

    def _begin(self, job: Job, placement: list[list[str]], keep: list[int] | None, why: str,
               now: float, blocks: list[int], release: bool = False, after_step: int = -1) -> list[SendToNode]:
        if job.spec.torchrun:   # no step boundary to hand over at: restart it there (elasticd.scheduler.recovery)
            return self.restarts.begin_restart(job, placement, blocks, why, now)
        src, dst = len(job.placement), len(placement)
        plan = ResizePlan.begin(epoch=job.epoch + 1, src=src, dst=dst, why=why, now=now, placement=placement,
                                step=job.step, timeout_s=self.host.cfg.resize_timeout_s, keep=keep,
                                blocks=blocks, src_blocks=job.blocks, release=release, after_step=after_step)
        job.epoch += 1
        job.resize = plan
        change = ("the agents held there go on" if release else
                  f"blocks {speeds.sizes(plan.src_blocks, job.spec.workers, src)} -> "
                  f"{speeds.sizes(plan.blocks, job.spec.workers, dst)}" if src == dst else f"{src} -> {dst} devices")
        job.transition(JobState.RESIZING, now, f"{why}: {change}")
        self.host.changed(job, resched=True)
        log.info("job %s resize %d: %d -> %d devices (%s) at step %d%s%s", job.job_id, plan.epoch, src, dst, why,
                 job.step, "; joiners on " + " ".join(f"{n}/{d}" for n, d in placement[src:]) if dst > src else "",
                 f"; prepared ahead, going after step {after_step}" if after_step >= 0 else "")
        lead = plan.placement[0][0]   # the new rank 0's node picks the rendezvous port
        out: list[SendToNode] = []
        for node in dict.fromkeys([lead, *plan.nodes()]):
            joiners = plan.joiners_on(node)
            if node != lead and not joiners:
                continue
            if node not in job.launched:
                job.launched.append(node)
            out.append(SendToNode(node, p.PrepareResize(
                job_id=job.job_id, epoch=plan.epoch, devices_from=src, devices=dst, pick_port=node == lead,
                joiners=[p.RankPlacement(rank=r, device_id=placement[r][1]) for r in joiners],
                script=job.spec.script, func=job.spec.func, workers=job.spec.workers, cwd=job.spec.cwd,
                env=job.spec.env, snapshot_every=job.spec.snapshot_every, blocks=list(plan.blocks),
                stuck_after=job.spec.stuck_after, run_as=job.spec.run_as, hold_at=job.hold_at,
                threads=job.spec.threads, device_memory=job.spec.device_memory)))
        return out

    # --- progress, from node reports --------------------------------------------------------------

    def report(self, job: Job, node: str, r: p.JobReport, now: float) -> list[SendToNode]:
        """A node's heartbeat about a resizing job (not rolling back: `rollbacks.report` takes those)."""
        plan = job.resize
        if plan is None or job.state is not JobState.RESIZING:
            return []
        self.rollbacks.note_saved(job, node, r)
        lead = plan.placement[0][0]   # the node of the new layout's rank 0
        preparing = plan.phase == ResizePhase.PREPARE
        actions: list[Action] = []
        refused = refused_at(r)
        if refused is not None and (r.resize_epoch == plan.epoch or refused[0] == job.held):
            # At the step boundary the agents could not capture a state and train on: after the go, or before
            # it at a scheduled step, where they stopped while the joiners warmed up. At the held step they may
            # refuse before any command reached them, and this resize began on the report of the step that
            # came before the refusal's: the refusal is this resize's all the same (they drop its command).
            return self._act(job, now, plan.refused(refused[1]))
        if r.resize_epoch == plan.epoch:
            if r.resize_error and preparing:
                why = str(r.resize_error.get("message", "a joining agent failed"))
                return self._act(job, now, plan.agent_failed(
                    now, {"message": f"a joining agent on {node} failed before the hand-over: {why}"}, joiner=True))
            if node == lead and r.resize_port and not plan.port:
                actions += plan.port_known(r.resize_port, now)
                self.host.changed(job)
        if preparing:
            here = {a.rank: a for a in r.agents}
            for rank in plan.joiners_on(node):
                a = here.get(rank)
                if a is not None and a.standby and a.connected and a.alive and rank not in plan.ready:
                    actions += plan.joiner_ready(rank, now)
                    self.host.changed(job)
            return self._act(job, now, actions)
        for a in r.agents:
            if (a.epoch == plan.epoch and not a.left and a.rank < plan.dst and plan.placement[a.rank][0] == node
                    and plan.reformed(a.rank)):
                self.host.changed(job)
        if node == lead:
            rank0 = next((a for a in r.agents if a.rank == 0 and not a.left), None)
            if rank0 is not None and rank0.stepped == plan.epoch:
                job.step = max(job.step, r.step)
                # The history records the step the agents actually stopped after, not the one current when asked.
                mine = [x for x in r.resizes if x.epoch == plan.epoch]
                plan.step = next((x.step for x in mine if x.step is not None), plan.step)
                handover = next((x.seconds for x in mine), None)
                stall = p.flat_metrics(r.metrics).get(STALL_METRIC)
                stall = float(stall) if isinstance(stall, int | float) and not isinstance(stall, bool) else None
                return self._act(job, now, plan.stepped(now, handover, stall))
        return []

    def _act(self, job: Job, now: float, actions: list[Action], gone: str | None = None) -> list[SendToNode]:
        """Carry out what the job's resize plan decided (`gone`: the node whose agents all died, if any)."""
        out: list[SendToNode] = []
        for action in actions:
            if isinstance(action, Go):
                out += self._go(job, now)
            elif isinstance(action, Done):
                out += self._complete_resize(job, now, action.seconds)
            elif isinstance(action, Abort):
                out += self._abort_resize(job, now, action.reason)
            elif isinstance(action, Refuse):
                out += self._refuse_resize(job, now, action.reason)
            elif isinstance(action, RollBack):
                out += self.rollbacks.begin(job, now, gone)
            elif isinstance(action, Fail):   # a rollback that timed out (`settle` takes the others)
                out += self.host.end_job(job, JobState.FAILED, now, action.reason, error=action.error)
        return out

    def agent_failed(self, job: Job, now: float, error: dict[str, Any], *, joiner: bool,
                     gone: str | None = None) -> list[SendToNode]:
        """An agent of a resizing job died or failed (`gone`: its node has no agent of the job left)."""
        plan = job.resize
        assert plan is not None
        return self._act(job, now, plan.agent_failed(now, error, joiner=joiner), gone)

    def _go(self, job: Job, now: float) -> list[SendToNode]:
        plan = job.resize
        assert plan is not None and plan.phase == ResizePhase.GO
        job.held = None   # agents held at a scheduled step take this command
        self.host.changed(job)
        lead = plan.placement[0][0]
        addr = self.host.nodes[lead].host if lead in self.host.nodes and self.host.nodes[lead].host else job.master_addr
        log.info("job %s resize %d: joiners ready after %.2fs; agents told to re-form at %s:%d", job.job_id,
                 plan.epoch, now - plan.requested_at, addr, plan.port)
        # Leavers stay warm where the schedule grows past the new size again: they join that grow sooner
        # than processes started for it (elasticd run keeps its leavers so too).
        grows = any(e.devices > plan.dst for e in job.spec.scale_at[job.scheduled:])
        msg = p.ResizeJob(job_id=job.job_id, devices=plan.dst, epoch=plan.epoch, master_addr=addr,
                          master_port=plan.port, devices_from=plan.src, keep=list(plan.keep),
                          blocks=list(plan.blocks), standby=bool(plan.leavers) and not plan.keep and grows)
        return [SendToNode(node, msg) for node in dict.fromkeys([*job.nodes, *plan.nodes()])]

    def _complete_resize(self, job: Job, now: float, seconds: float) -> list[SendToNode]:
        plan = job.resize
        assert plan is not None
        kept = {tuple(x) for x in plan.placement}
        for node, dev in job.placement:
            if (node, dev) not in kept:   # a rank that left: its device frees once its agent is gone
                job.zombies.setdefault(node, [])
                if dev not in job.zombies[node]:
                    job.zombies[node].append(dev)
        job.placement = [list(x) for x in plan.placement]
        job.blocks = list(plan.blocks)
        self.host.speeds.relaid(job.job_id)
        lead = self.host.nodes.get(job.placement[0][0])
        if lead is not None and lead.host:   # a drain may have moved rank 0 to another node
            job.master_addr = lead.host
        for node in list(job.launched):
            if node not in job.nodes and node in job.ended:   # hosted only ranks that left, all gone now
                job.launched.remove(node)
                job.ended.remove(node)
                job.zombies.pop(node, None)
        if not plan.release:   # a release is no resize of the user's: the scheduled entry was recorded
            job.record_resize(plan, ResizeOutcome.DONE, seconds=seconds)
        job.resize = None
        what = (f"released the agents held after step {plan.step}" if plan.release else
                "re-laid out" if plan.src == plan.dst else f"resized {plan.src} -> {plan.dst} devices")
        job.transition(JobState.RUNNING, now, f"{what} in {seconds:.2f}s")
        self.host.changed(job, resched=True)
        log.info("job %s resize %d done: %d -> %d devices in %.2fs (hand-over %.2fs)", job.job_id, plan.epoch,
                 plan.src, plan.dst, seconds, plan.handover_s or 0.0)
        return []

    # --- ending ----------------------------------------------------------------------------------

    def _abort_resize(self, job: Job, now: float, reason: str) -> list[SendToNode]:
        """Phase 1 went wrong: stop the joiners; the job goes on at its old size, untouched."""
        assert job.resize is not None and job.resize.phase == ResizePhase.PREPARE
        return self._call_off(job, now, reason, ResizeOutcome.ABORTED)

    def _refuse_resize(self, job: Job, now: float, reason: str) -> list[SendToNode]:
        """After the go, the agents found a state they cannot carry and train on at the old size: every node
        of both layouts undoes the go (joiners sent away, leavers kept); the job keeps its placement."""
        assert job.resize is not None and job.resize.phase == ResizePhase.REFUSED
        return self._call_off(job, now, reason, ResizeOutcome.REFUSED)

    def _call_off(self, job: Job, now: float, reason: str, outcome: ResizeOutcome) -> list[SendToNode]:
        """The resize did not happen (`outcome`: "aborted" before the go, "refused" by the agents after it)."""
        plan = job.resize
        assert plan is not None
        out = self._drop_joiners(job, plan, reason)
        if outcome is ResizeOutcome.REFUSED:   # the go reached the old layout's nodes too: each undoes it
            told = {s.node_id for s in out}
            out += [SendToNode(node, p.AbortResize(job_id=job.job_id, epoch=plan.epoch, reason=reason))
                    for node in dict.fromkeys(job.nodes) if node not in told and node not in job.ended]
        if not plan.release:
            job.record_resize(plan, outcome, note=reason)
        elif outcome is ResizeOutcome.ABORTED:
            job.held = plan.step   # the command never reached the held agents: release them again
        if plan.ahead:
            # Called off before the job reached its step: the entry is handled there after all (its agents
            # still hold after it), as if it had not been prepared ahead.
            job.scheduled -= 1
        job.resize = None
        if outcome is ResizeOutcome.REFUSED:
            job.held = None   # they refused at the held step and train on: nothing to release
            job.drop_schedule(reason, now)   # the agents dropped the steps they were to hold after
        if plan.dst != plan.src:
            # Pinned at the size it has, so the policy does not retry the same resize in a loop (a
            # re-layout is not retried before the gate's cooldown either).
            job.requested_devices = plan.src
        what = "aborted" if outcome is ResizeOutcome.ABORTED else "refused by its agents"
        job.transition(JobState.RUNNING, now, f"resize {plan.src} -> {plan.dst} {what}: {reason}")
        self.host.changed(job, resched=True)
        log.warning("job %s resize %d %s, continuing on %d devices: %s", job.job_id, plan.epoch, what, plan.src,
                    reason)
        return out

    def _drop_joiners(self, job: Job, plan: ResizePlan, reason: str) -> list[SendToNode]:
        out: list[SendToNode] = []
        for node in plan.nodes():
            joiners = plan.joiners_on(node)
            if not joiners or node in job.ended:   # ended: every agent of the job there is gone already
                continue
            devs = job.zombies.setdefault(node, [])
            devs += [plan.placement[r][1] for r in joiners if plan.placement[r][1] not in devs]
            out.append(SendToNode(node, p.AbortResize(job_id=job.job_id, epoch=plan.epoch, reason=reason)))
        return out

    def close(self, job: Job, now: float, ending: str) -> list[SendToNode]:
        """The job ends (`ending`: finished, failed, stopped) with a resize in flight: record it, free its
        joiners' devices once they are gone."""
        plan = job.resize
        if plan is None:
            return []
        out: list[SendToNode] = []
        if plan.phase == ResizePhase.PREPARE:
            out = self._drop_joiners(job, plan, f"job {ending}")
            outcome, note = ResizeOutcome.NOT_APPLIED, f"the job {ending} before the hand-over"
        elif ending == "finished" and len(plan.acked) == plan.dst:
            outcome, note = ResizeOutcome.DONE, "the job finished right after the hand-over"
        elif ending == "finished" and not job.entered_steps:
            outcome, note = ResizeOutcome.REFUSED, ("the job never reached a step boundary of `ctx.steps`, the only place a job "
                                        "can be resized; drive its loop with `for step in ctx.steps(n)` to resize it")
        elif ending == "finished":
            outcome, note = ResizeOutcome.NOT_APPLIED, "the job finished before its agents reached a step boundary"
        elif ending == "failed":
            outcome, note = ResizeOutcome.FAILED, "the job failed during the hand-over"
        else:
            outcome, note = ResizeOutcome.NOT_APPLIED, f"the job was {ending} during the hand-over"
        for node in plan.nodes():
            if node in job.ended:
                continue
            for r in plan.joiners_on(node):
                devs = job.zombies.setdefault(node, [])
                if plan.placement[r][1] not in devs:
                    devs.append(plan.placement[r][1])
        job.record_resize(plan, outcome, note=note)
        if plan.ahead:
            job.scheduled -= 1   # its step not reached: a job restarted from a snapshot still resizes there
        job.resize = None
        self.host.changed(job)
        return out

    def node_ended(self, job: Job, node: str, r: p.JobReport, now: float) -> list[SendToNode] | None:
        """A node that is not (or no longer) part of the job's layout reports its agents all gone.

        Returns None when the node still belongs to the job's current layout (the caller's business).
        """
        if node in job.nodes:
            return None
        plan = job.resize
        if plan is not None and node in plan.nodes():   # it hosts only joining ranks
            if plan.phase == ResizePhase.PREPARE:
                err = (r.error or r.resize_error or {}).get("message", "agents exited")
                return self.agent_failed(job, now, {"message": f"the joining agents on {node} are gone: {err}"},
                                         joiner=True)
            if not r.ok:
                err = dict(p.flat_scalars(r.error or {}))
                err["node"] = node
                return self.agent_failed(job, now, err, joiner=True, gone=node)
            if node not in job.ended:
                job.ended.append(node)
            return []
        # Leftovers of an earlier resize (ranks that left, aborted joiners): forget the node.
        if not r.ok:
            log.warning("job %s: agents that had left it on %s exited badly: %s", job.job_id, node,
                        (r.error or {}).get("message"))
        job.zombies.pop(node, None)
        if node in job.launched:
            job.launched.remove(node)
        if node in job.ended:
            job.ended.remove(node)
        self.host.changed(job, resched=True)
        return []

    @staticmethod
    def name_error(job: Job, err: dict[str, Any]) -> dict[str, Any]:
        """Name the resize in an error that happened while the job was re-forming."""
        return job.resize.name_in(err) if job.resize is not None else err

    def tick(self, now: float) -> list[SendToNode]:
        """Phases past their deadline."""
        out: list[SendToNode] = []
        for job in list(self.host.jobs.values()):
            plan = job.resize
            if plan is not None and job.state is JobState.RESIZING:
                out += self._act(job, now, plan.tick(now, job.launched))
        return out


def refused_at(r: p.JobReport) -> tuple[int, str] | None:
    """(step, why) where the report says the agents refused a resize at a step boundary, else None."""
    e = r.resize_error
    if not e or not e.get("refused") or not isinstance(e.get("step"), int):
        return None
    return int(e["step"]), str(e.get("message", "refused by its agents"))
