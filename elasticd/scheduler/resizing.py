"""Live resize, the scheduler's half: plan the new layout, prepare it, tell the nodes to go, see it through.

One resize of a running job from M to M2 devices (layout epoch E):

1. `begin_resize` picks the new layout -- ranks 0..min(M, M2)-1 keep their devices (agents that stay
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
from typing import TYPE_CHECKING, Any

from elasticd import protocol as p
from elasticd.scheduler import policy
from elasticd.scheduler.actions import Send
from elasticd.scheduler.jobs import Job, JobState, ResizePlan
from elasticd.scheduler.rollback import ResizeRollback

if TYPE_CHECKING:
    from elasticd.scheduler.state import Config, Node

log = logging.getLogger(__name__)
_send = Send


class ResizeCoordinator(ResizeRollback):
    """The resize half of `SchedulerState` (a mixin: it shares the job and node tables)."""

    cfg: Config
    jobs: dict[str, Job]
    nodes: dict[str, Node]
    dirty: set[str]
    _resched: bool

    if TYPE_CHECKING:   # provided by SchedulerState
        def _free_views(self) -> list[policy.NodeView]: ...

        def _end(self, job: Job, dst: JobState, now: float, reason: str, *, error: dict[str, Any] | None = None,
                 gone: str | None = None) -> list[Send]: ...

    # --- starting ------------------------------------------------------------------------------------

    def free_count(self) -> int:
        return sum(len(v.free) for v in self._free_views())

    def begin_resize(self, job: Job, dst: int, why: str, now: float) -> list[Send]:
        """Start moving a running job to `dst` devices (phase 1).

        Raises:
            ValueError: a grow needs more devices than are free (callers check `free_count` first).
        """
        assert job.state is JobState.RUNNING and job.resize is None, (job.job_id, job.state)
        src = len(job.placement)
        if dst > src:
            chosen = policy.spread(dst - src, self._free_views())
            placement = [list(x) for x in job.placement] + [[n, d] for n, d in chosen]
        else:
            placement = [list(x) for x in job.placement[:dst]]
        job.epoch += 1
        plan = ResizePlan(epoch=job.epoch, src=src, dst=dst, why=why, requested_at=now, placement=placement,
                          deadline=now + self.cfg.resize_timeout_s, step=job.step)
        job.resize = plan
        job.transition(JobState.RESIZING, now, f"{why}: {src} -> {dst} devices")
        self.dirty.add(job.job_id)
        self._resched = True
        log.info("job %s resize %d: %d -> %d devices (%s) at step %d%s", job.job_id, plan.epoch, src, dst, why,
                 job.step, "; joiners on " + " ".join(f"{n}/{d}" for n, d in placement[src:]) if dst > src else "")
        lead = job.placement[0][0]
        out: list[Send] = []
        for node in dict.fromkeys([lead, *plan.nodes()]):
            joiners = plan.joiners_on(node)
            if node != lead and not joiners:
                continue
            if node not in job.launched:
                job.launched.append(node)
            out.append(_send(node, p.PrepareResize(
                job_id=job.job_id, epoch=plan.epoch, world_from=src, world=dst, pick_port=node == lead,
                joiners=[p.RankPlacement(rank=r, device_id=placement[r][1]) for r in joiners],
                script=job.spec.script, func=job.spec.func, workers=job.spec.workers, cwd=job.spec.cwd,
                env=job.spec.env)))
        return out

    # --- progress, from node reports --------------------------------------------------------------

    def _resize_report(self, job: Job, node: str, r: p.JobReport, now: float) -> list[Send]:
        plan = job.resize
        if plan is None or job.state is not JobState.RESIZING:
            return []
        self.note_saved(job, node, r)
        lead = job.placement[0][0]
        if r.resize_epoch == plan.epoch:
            if node == lead and r.resize_port and not plan.port:
                plan.port = r.resize_port
                self.dirty.add(job.job_id)
            if r.resize_error and plan.phase == "prepare":
                why = str(r.resize_error.get("message", "a joining agent failed"))
                return self._abort_resize(job, now, f"a joining agent on {node} failed before the hand-over: {why}")
        if plan.phase == "prepare":
            here = {a.rank: a for a in r.agents}
            for rank in plan.joiners_on(node):
                a = here.get(rank)
                if a is not None and a.standby and a.connected and a.alive and rank not in plan.ready:
                    plan.ready.append(rank)
                    self.dirty.add(job.job_id)
            if plan.port and len(plan.ready) == len(plan.joiners):
                return self._go(job, now)
            return []
        for a in r.agents:
            if (a.epoch == plan.epoch and not a.left and a.rank < plan.dst and a.rank not in plan.acked
                    and plan.placement[a.rank][0] == node):
                plan.acked.append(a.rank)
                self.dirty.add(job.job_id)
        if node == lead:
            rank0 = next((a for a in r.agents if a.rank == 0 and not a.left), None)
            if rank0 is not None and rank0.stepped == plan.epoch:
                job.step = max(job.step, r.step)
                plan.handover_s = next((x.get("seconds") for x in r.resizes if x.get("epoch") == plan.epoch
                                        and isinstance(x.get("seconds"), float)), None)
                # The history records the step the agents actually stopped after, not the one current when asked.
                plan.step = next((x["step"] for x in r.resizes if x.get("epoch") == plan.epoch
                                  and isinstance(x.get("step"), int) and not isinstance(x.get("step"), bool)),
                                 plan.step)
                if len(plan.acked) == plan.dst:
                    return self._complete_resize(job, now)
        return []

    def _go(self, job: Job, now: float) -> list[Send]:
        plan = job.resize
        assert plan is not None
        plan.phase = "go"
        plan.commanded_at = now
        plan.deadline = now + self.cfg.resize_timeout_s
        self.dirty.add(job.job_id)
        lead = job.placement[0][0]
        addr = self.nodes[lead].host if lead in self.nodes and self.nodes[lead].host else job.master_addr
        log.info("job %s resize %d: joiners ready after %.2fs; agents told to re-form at %s:%d", job.job_id,
                 plan.epoch, now - plan.requested_at, addr, plan.port)
        msg = p.ResizeJob(job_id=job.job_id, devices=plan.dst, epoch=plan.epoch, master_addr=addr,
                          master_port=plan.port, world_from=plan.src)
        return [_send(node, msg) for node in dict.fromkeys([*job.nodes, *plan.nodes()])]

    def _complete_resize(self, job: Job, now: float) -> list[Send]:
        plan = job.resize
        assert plan is not None
        kept = {tuple(x) for x in plan.placement}
        for node, dev in job.placement:
            if (node, dev) not in kept:   # a rank that left: its device frees once its agent is gone
                job.zombies.setdefault(node, [])
                if dev not in job.zombies[node]:
                    job.zombies[node].append(dev)
        job.placement = [list(x) for x in plan.placement]
        for node in list(job.launched):
            if node not in job.nodes and node in job.ended:   # hosted only ranks that left, all gone now
                job.launched.remove(node)
                job.ended.remove(node)
                job.zombies.pop(node, None)
        seconds = now - plan.requested_at
        self._record(job, plan, "done", seconds=seconds)
        job.resize = None
        job.transition(JobState.RUNNING, now, f"resized {plan.src} -> {plan.dst} devices in {seconds:.2f}s")
        self.dirty.add(job.job_id)
        self._resched = True
        log.info("job %s resize %d done: %d -> %d devices in %.2fs (hand-over %.2fs)", job.job_id, plan.epoch,
                 plan.src, plan.dst, seconds, plan.handover_s or 0.0)
        return []

    # --- ending ----------------------------------------------------------------------------------

    def _abort_resize(self, job: Job, now: float, reason: str) -> list[Send]:
        """Phase 1 went wrong: stop the joiners; the job goes on at its old size, untouched."""
        plan = job.resize
        assert plan is not None and plan.phase == "prepare"
        out = self._drop_joiners(job, plan, reason)
        self._record(job, plan, "aborted", note=reason)
        job.resize = None
        # Pinned at the size it has, so the policy does not retry the same resize in a loop.
        job.requested_devices = plan.src
        job.transition(JobState.RUNNING, now, f"resize {plan.src} -> {plan.dst} aborted: {reason}")
        self.dirty.add(job.job_id)
        self._resched = True
        log.warning("job %s resize %d aborted, continuing on %d devices: %s", job.job_id, plan.epoch, plan.src,
                    reason)
        return out

    def _drop_joiners(self, job: Job, plan: ResizePlan, reason: str) -> list[Send]:
        out: list[Send] = []
        for node in plan.nodes():
            joiners = plan.joiners_on(node)
            if not joiners or node in job.ended:   # ended: every agent of the job there is gone already
                continue
            devs = job.zombies.setdefault(node, [])
            devs += [plan.placement[r][1] for r in joiners if plan.placement[r][1] not in devs]
            out.append(_send(node, p.AbortResize(job_id=job.job_id, epoch=plan.epoch, reason=reason)))
        return out

    def _close_resize(self, job: Job, now: float, ending: str) -> list[Send]:
        """The job ends (`ending`: finished, failed, stopped) with a resize in flight: record it, free its
        joiners' devices once they are gone."""
        plan = job.resize
        if plan is None:
            return []
        out: list[Send] = []
        if plan.phase == "prepare":
            out = self._drop_joiners(job, plan, f"job {ending}")
            outcome, note = "not applied", f"the job {ending} before the hand-over"
        elif ending == "finished" and len(plan.acked) == plan.dst:
            outcome, note = "done", "the job finished right after the hand-over"
        elif ending == "finished" and not job.entered_steps:
            outcome, note = "refused", ("the job never reached a step boundary of `ctx.steps`, the only place a job "
                                        "can be resized; drive its loop with `for step in ctx.steps(n)` to resize it")
        elif ending == "finished":
            outcome, note = "not applied", "the job finished before its agents reached a step boundary"
        elif ending == "failed":
            outcome, note = "failed", "the job failed during the hand-over"
        else:
            outcome, note = "not applied", f"the job was {ending} during the hand-over"
        for node in plan.nodes():
            if node in job.ended:
                continue
            for r in plan.joiners_on(node):
                devs = job.zombies.setdefault(node, [])
                if plan.placement[r][1] not in devs:
                    devs.append(plan.placement[r][1])
        self._record(job, plan, outcome, note=note)
        job.resize = None
        self.dirty.add(job.job_id)
        return out

    def _resize_ended(self, job: Job, node: str, r: p.JobReport, now: float) -> list[Send] | None:
        """A node that is not (or no longer) part of the job's layout reports its agents all gone.

        Returns None when the node still belongs to the job's current layout (the caller's business).
        """
        if node in job.nodes:
            return None
        plan = job.resize
        if plan is not None and node in plan.nodes():   # it hosts only joining ranks
            if plan.phase == "prepare":
                err = (r.error or r.resize_error or {}).get("message", "agents exited")
                return self._abort_resize(job, now, f"the joining agents on {node} are gone: {err}")
            if not r.ok:
                err = dict(p.flat_scalars(r.error or {}))
                err["node"] = node
                return self.begin_rollback(job, now, self._resize_error(job, err), gone=node)
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
        self.dirty.add(job.job_id)
        self._resched = True
        return []

    def _resize_error(self, job: Job, err: dict[str, Any]) -> dict[str, Any]:
        """Name the resize in an error that happened while the job was re-forming."""
        plan = job.resize
        if plan is None or plan.phase != "go":
            return err
        err = dict(err)
        err["message"] = (f"resize {plan.epoch} ({plan.src} -> {plan.dst} devices, {plan.why}) failed: "
                          f"{err.get('message', 'agent failed')}")
        err["resize_epoch"] = plan.epoch
        return err

    def _resize_tick(self, now: float) -> list[Send]:
        out: list[Send] = []
        for job in list(self.jobs.values()):
            plan = job.resize
            if plan is None or job.state is not JobState.RESIZING or now <= plan.deadline:
                continue
            t = self.cfg.resize_timeout_s
            if plan.phase == "rollback":
                out += self.rollback_tick(job, now)
            elif plan.phase == "prepare":
                missing = [r for r in plan.joiners if r not in plan.ready]
                what = f"joining ranks {missing} not ready" if missing else "no rendezvous port from rank 0's node"
                out += self._abort_resize(job, now, f"{what} within {t:.0f}s")
            else:
                missing = [r for r in range(plan.dst) if r not in plan.acked]
                what = f"ranks {missing} did not re-form" if missing else "rank 0 did not complete a step"
                out += self.begin_rollback(job, now, self._resize_error(job, {"message": f"{what} within {t:.0f}s"}))
        return out

    def _record(self, job: Job, plan: ResizePlan, outcome: str, seconds: float | None = None,
                note: str = "") -> None:
        entry: dict[str, Any] = {
            "epoch": plan.epoch, "at": round(plan.requested_at, 3), "from": plan.src, "to": plan.dst,
            "why": plan.why, "step": plan.step, "outcome": outcome,
            "seconds": round(seconds, 3) if seconds is not None else None,
            "handover_s": round(plan.handover_s, 3) if plan.handover_s is not None else None,
        }
        if plan.commanded_at is not None:
            entry["prepare_s"] = round(plan.commanded_at - plan.requested_at, 3)   # joiners warming up
        if outcome == "done":
            entry["done_step"] = job.step   # rank 0's step when it was seen done
        if note:
            entry["note"] = note
        job.resizes.append(entry)
        del job.resizes[:-100]   # bounded: a job resized by policy for weeks must not grow its row forever
