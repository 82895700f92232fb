"""A resize that fails half-way falls back to the snapshot its agents saved when it began.

At the step boundary of resize E every agent writes its logical ranks' state, and agent 0 the
replicated state, into its node's snapshot directory before any state moves (agent/resize/fallback.py);
nodes report which parts they hold. When an agent dies while the group re-forms (phase ``go``), or
the re-forming does not finish in time, the job's `ResizePlan` (elasticd.resize_plan) says `RollBack` and
the scheduler:

1. stops every agent of the job on every node it was launched on, at once (no stop command first:
   the agents are not at a step boundary, they may be blocked in a rendezvous or a transfer), and
   waits until every node reports them gone; the last reports also list the saved parts;
2. if the plan says `FallBack` (the parts of E cover every logical rank and the replicated state, and
   the nodes of the old layout are alive), starts the job again on the devices it had before the resize with
   ``restore_epoch=E``: the new agents load the parts from their node (and trade the ones saved on
   another node), and the job continues at the step it stopped at. The resize is recorded
   ``rolled back``, the job pinned at its old size so the policy does not retry the same resize in a
   loop, and the devices reserved for joiners are free again;
3. otherwise (`Fail`: a part was never saved, its agent died before writing it, or a node is gone) the
   job fails with the original error and what is missing.

A failure of the restarted job itself is an ordinary failure: there is no second fall-back.

`Rollbacks` is the shell that carries this out against the scheduler's tables; `SchedulerState` holds
one (through `elasticd.scheduler.resizing.Resizes`) and it sees the state only as a `ResizeHost`.
"""

from __future__ import annotations

import logging

from elasticd import protocol as p
from elasticd.core.lifecycle import ResizeOutcome, ResizePhase
from elasticd.resize_plan import Fail, FallBack
from elasticd.scheduler.actions import SendToNode
from elasticd.scheduler.host import ResizeHost
from elasticd.scheduler.jobs import Job, JobState

log = logging.getLogger(__name__)


class Rollbacks:
    """Stops a job whose hand-over failed and restarts it from its snapshot (or fails it)."""

    def __init__(self, host: ResizeHost) -> None:
        self.host = host

    @staticmethod
    def rolling_back(job: Job) -> bool:
        return job.resize is not None and job.resize.phase == ResizePhase.ROLLBACK

    def begin(self, job: Job, now: float, gone: str | None = None) -> list[SendToNode]:
        """The plan rolled back (`RollBack`): stop every agent; the job restarts once they are all gone."""
        plan = job.resize
        assert plan is not None and plan.phase == ResizePhase.ROLLBACK, job.job_id
        # Nodes where every agent of the job already exited (ranks that left in a shrink, say) count as gone.
        for node in [*job.ended, *([gone] if gone else [])]:
            plan.place_gone(node)
        self.host.changed(job)
        log.warning("job %s resize %d failed half-way (%s); stopping its agents to fall back to the snapshot",
                    job.job_id, plan.epoch, (plan.failure or {}).get("message"))
        out: list[SendToNode] = []
        for node in job.launched:
            if node not in plan.gone:
                out += self.host.kill(node, job.job_id, now, f"resize {plan.epoch} failed; falling back",
                                      force=True, hard=True)
        return out + self.settle(job, now)

    def note_saved(self, job: Job, node: str, r: p.JobReport) -> None:
        """Keep track of the snapshot parts each node holds for the resize in flight."""
        plan = job.resize
        if plan is not None and r.snapshot_epoch == plan.epoch and plan.note_saved(node, r.snapshot_parts):
            self.host.changed(job)

    def report(self, job: Job, node: str, r: p.JobReport, now: float) -> list[SendToNode]:
        """A node's heartbeat about a job that is rolling back."""
        plan = job.resize
        assert plan is not None
        self.note_saved(job, node, r)
        if r.state != "ended":
            return self.host.kill(node, job.job_id, now, f"resize {plan.epoch} failed; falling back", hard=True)
        if plan.place_gone(node):
            self.host.changed(job)
        return self.settle(job, now)

    def settle(self, job: Job, now: float) -> list[SendToNode]:
        """Restart from the snapshot once no agent of the job runs anywhere (or fail, when it cannot)."""
        plan = job.resize
        assert plan is not None
        nodes = self.host.nodes
        dead = [n for n in job.nodes if n not in nodes or not nodes[n].alive]
        out: list[SendToNode] = []
        for action in plan.settle(job.launched, job.spec.workers, dead):
            if isinstance(action, FallBack):
                out += self._fall_back(job, now)
            elif isinstance(action, Fail):
                # Every agent of the job is gone on the nodes that reported so: nothing to kill or wait for there.
                job.ended = list(dict.fromkeys([*job.ended, *plan.gone]))
                out += self.host.end_job(job, JobState.FAILED, now, action.reason, error=action.error)
        return out

    def lost(self, job: Job, node: str) -> bool:
        """A node died: if it hosted only joiners, the rollback goes on without it. False: the job fails."""
        plan = job.resize
        if plan is None or plan.phase not in (ResizePhase.GO, ResizePhase.ROLLBACK) or node in job.nodes:
            return False
        if node in job.launched:
            job.launched.remove(node)
        job.zombies.pop(node, None)
        return True

    def _fall_back(self, job: Job, now: float) -> list[SendToNode]:
        """Restart the job on its old devices from the snapshot of this resize."""
        plan = job.resize
        assert plan is not None
        reason = plan.reason()
        job.record_resize(plan, ResizeOutcome.ROLLED_BACK, seconds=now - plan.requested_at,
                          note=f"{reason}; restarted on its {plan.src} devices from the snapshot of this resize")
        job.resize = None
        job.blocks = list(plan.src_blocks)   # back on its old layout: the snapshot restores on any
        if plan.dst != plan.src:   # a failed re-layout is not retried before the gate's cooldown
            job.requested_devices = plan.src   # the user's (or the policy's) next word decides, not a retry loop
        job.restore_epoch = plan.epoch
        job.launched, job.ready, job.ended = [], [], []
        job.master_port = 0
        job.agents = {}
        job.transition(JobState.STARTING, now, f"resize {plan.epoch} ({plan.src} -> {plan.dst}) failed half-way: "
                                               f"{reason}; restarting on {plan.src} devices from its snapshot")
        self.host.changed(job, resched=True)   # the joiners' devices are free again
        log.warning("job %s: falling back to the snapshot of resize %d on %d devices", job.job_id, plan.epoch,
                    plan.src)
        # Rank 0's node goes first: it picks the rendezvous port (as in a first start).
        return [self.host.launch(job, job.nodes[0])]
