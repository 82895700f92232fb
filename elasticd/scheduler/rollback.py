"""A resize that fails half-way falls back to the snapshot its agents saved when it began.

At the step boundary of resize E every agent writes its logical ranks' state, and agent 0 the
replicated state, into its node's snapshot directory before any state moves (agent/resize/fallback.py);
nodes report which parts they hold. When an agent dies while the group re-forms (phase ``go``), or
the re-forming does not finish in time, the scheduler:

1. stops every agent of the job on every node it was launched on, at once (no stop command first:
   the agents are not at a step boundary, they may be blocked in a rendezvous or a transfer), and
   waits until every node reports them gone; the last reports also list the saved parts;
2. if the parts of E cover every logical rank and the replicated state, and the nodes of the old
   layout are alive, starts the job again on the devices it had before the resize with
   ``restore_epoch=E``: the new agents load the parts from their node (and trade the ones saved on
   another node), and the job continues at the step it stopped at. The resize is recorded
   ``rolled back``, the job pinned at its old size so the policy does not retry the same resize in a
   loop, and the devices reserved for joiners are free again;
3. otherwise (a part was never saved: its agent died before writing it, or a node is gone) the job
   fails with the original error and what is missing.

A failure of the restarted job itself is an ordinary failure: there is no second fall-back.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from elasticd import protocol as p
from elasticd.agent.resize import parts
from elasticd.scheduler.actions import Send
from elasticd.scheduler.jobs import Job, JobState

if TYPE_CHECKING:
    from elasticd.scheduler.state import Config, Node

log = logging.getLogger(__name__)


class ResizeRollback:
    """The fall-back half of `SchedulerState` (a mixin: it shares the job and node tables)."""

    cfg: Config
    nodes: dict[str, Node]
    dirty: set[str]
    _resched: bool

    if TYPE_CHECKING:   # provided by SchedulerState
        def _end(self, job: Job, dst: JobState, now: float, reason: str, *, error: dict[str, Any] | None = None,
                 gone: str | None = None) -> list[Send]: ...

        def _kill(self, node: str, job_id: str, now: float, reason: str, force: bool = False,
                  hard: bool = False) -> list[Send]: ...

        def _launch(self, job: Job, node: str) -> Send: ...

        def _record(self, job: Job, plan: Any, outcome: str, seconds: float | None = None,
                    note: str = "") -> None: ...

    def rolling_back(self, job: Job) -> bool:
        return job.resize is not None and job.resize.phase == "rollback"

    def begin_rollback(self, job: Job, now: float, error: dict[str, Any], gone: str | None = None) -> list[Send]:
        """Phase ``go`` went wrong: stop every agent; the job restarts once they are all gone."""
        plan = job.resize
        assert plan is not None and plan.phase == "go", job.job_id
        plan.phase = "rollback"
        plan.failure = error
        plan.deadline = now + self.cfg.resize_timeout_s
        # Nodes where every agent of the job already exited (ranks that left in a shrink, say) count as gone.
        plan.gone = list(dict.fromkeys([*job.ended, *([gone] if gone else [])]))
        self.dirty.add(job.job_id)
        log.warning("job %s resize %d failed half-way (%s); stopping its agents to fall back to the snapshot",
                    job.job_id, plan.epoch, error.get("message"))
        out: list[Send] = []
        for node in job.launched:
            if node not in plan.gone:
                out += self._kill(node, job.job_id, now, f"resize {plan.epoch} failed; falling back",
                                  force=True, hard=True)
        return out + self.maybe_fall_back(job, now)

    def note_saved(self, job: Job, node: str, r: p.JobReport) -> None:
        """Keep track of the snapshot parts each node holds for the resize in flight."""
        plan = job.resize
        if plan is not None and r.snapshot_epoch == plan.epoch and plan.saved.get(node) != r.snapshot_parts:
            plan.saved[node] = list(r.snapshot_parts)
            self.dirty.add(job.job_id)

    def rollback_report(self, job: Job, node: str, r: p.JobReport, now: float) -> list[Send]:
        plan = job.resize
        assert plan is not None
        self.note_saved(job, node, r)
        if r.state != "ended":
            return self._kill(node, job.job_id, now, f"resize {plan.epoch} failed; falling back", hard=True)
        if node not in plan.gone:
            plan.gone.append(node)
            self.dirty.add(job.job_id)
        return self.maybe_fall_back(job, now)

    def maybe_fall_back(self, job: Job, now: float) -> list[Send]:
        """Restart from the snapshot once no agent of the job runs anywhere."""
        plan = job.resize
        assert plan is not None
        return self._fall_back(job, now) if all(n in plan.gone for n in job.launched) else []

    def lost_in_rollback(self, job: Job, node: str) -> bool:
        """A node died: if it hosted only joiners, the rollback goes on without it. False: the job fails."""
        plan = job.resize
        if plan is None or plan.phase not in ("go", "rollback") or node in job.nodes:
            return False
        if node in job.launched:
            job.launched.remove(node)
        job.zombies.pop(node, None)
        return True

    def rollback_tick(self, job: Job, now: float) -> list[Send]:
        plan = job.resize
        assert plan is not None
        waiting = [n for n in job.launched if n not in plan.gone]
        return self._end(job, JobState.FAILED, now, f"resize {plan.epoch} rollback timed out",
                         error=self._failure(job, f"its agents on {waiting} did not exit within "
                                                  f"{self.cfg.resize_timeout_s:.0f}s, so it could not fall back"))

    def _fall_back(self, job: Job, now: float) -> list[Send]:
        plan = job.resize
        assert plan is not None
        lost = parts.missing(job.spec.workers, {part for saved in plan.saved.values() for part in saved})
        dead = [n for n in job.nodes if n not in self.nodes or not self.nodes[n].alive]
        if lost or dead:
            # Every agent of the job is gone on the nodes that reported so: nothing to kill or wait for there.
            job.ended = list(dict.fromkeys([*job.ended, *plan.gone]))
            what = (f"nodes {dead} of its layout are gone" if dead else
                    "its snapshot lacks " + parts.describe(lost) + " (an agent died before saving it)")
            return self._end(job, JobState.FAILED, now, f"resize {plan.epoch} failed",
                             error=self._failure(job, f"no complete snapshot to fall back to: {what}"))
        reason = str((plan.failure or {}).get("message", "an agent failed"))
        self._record(job, plan, "rolled back", seconds=now - plan.requested_at,
                     note=f"{reason}; restarted on its {plan.src} devices from the snapshot of this resize")
        job.resize = None
        job.requested_devices = plan.src   # the user's (or the policy's) next word decides, not a retry loop
        job.restore_epoch = plan.epoch
        job.launched, job.ready, job.ended = [], [], []
        job.master_port = 0
        job.agents = {}
        job.transition(JobState.STARTING, now, f"resize {plan.epoch} ({plan.src} -> {plan.dst}) failed half-way: "
                                               f"{reason}; restarting on {plan.src} devices from its snapshot")
        self.dirty.add(job.job_id)
        self._resched = True   # the joiners' devices are free again
        log.warning("job %s: falling back to the snapshot of resize %d on %d devices", job.job_id, plan.epoch,
                    plan.src)
        # Rank 0's node goes first: it picks the rendezvous port (as in a first start).
        return [self._launch(job, job.nodes[0])]

    def _failure(self, job: Job, why: str) -> dict[str, Any]:
        plan = job.resize
        assert plan is not None
        err = dict(plan.failure or {"message": "resize failed"})
        err["message"] = f"{err.get('message', 'resize failed')}; {why}"
        return err
