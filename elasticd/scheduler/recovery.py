"""Recovery: a job whose agent died, or whose node was lost, restarts from its newest complete snapshot.

Agents take periodic snapshots at step boundaries (agent/resize/periodic.py) into their node's tmpfs. When
an agent dies without saying why (a signal, the OOM killer: the node reports cause ``died``), its group
fails under the others (``peer_lost``), or a node stops heartbeating, the job is not failed. Instead:

1. the job goes ``recovering``: every agent of it is killed on every node it was launched on (no stop
   command: the survivors are blocked in a collective that will never finish), and the scheduler waits
   until each node reports them gone (or is itself gone);
2. it restarts (``starting``) on the devices it still has: the same ones, or those left on live nodes
   when a node is gone -- fewer, within ``--min-devices``; the policy grows it back later. Its agents
   start with ``restore_latest``: they pick, among themselves, the newest periodic snapshot whose every
   part is on one of their nodes, and continue from its step. The logical world N never changes, so
   what the job computes does not either. Fewer live devices than ``--min-devices`` send it back to the
   queue, to restart the same way once devices free up.

A worker that raised (cause ``user``) is never retried: the job fails with its rank and traceback, even
when an agent that lost its group after it reported first. ``--max-restarts`` bounds the restarts; the
job's ``recoveries`` list records each one: cause, step it failed after, step resumed from, steps redone,
seconds from the failure to the first step after it.

A torchrun-mode job (a script with no `@elastic` function, so no step boundary at which its state could
move) resizes the same way, as torchelastic does on a membership change: `begin_restart` stops every agent
and `settle` starts the job on the new devices, where the script starts again (from its own checkpoint if
it loads one) with TORCHELASTIC_RESTART_COUNT one higher. Such a restart is a resize of the job's history
(outcome ``restarting``, then ``restarted`` at its first step), not a recovery: it does not count against
``--max-restarts``. Scale commands, the policy's shrinks and grows and drains all take this path.

`Recoveries` is the shell that carries this out against the scheduler's tables, as `Rollbacks` does for
failed resizes; it sees the state only as a `ResizeHost`.
"""

from __future__ import annotations

import logging
from typing import Any

from elasticd import protocol as p
from elasticd.core.failures import Cause, is_infrastructure, no_restart
from elasticd.core.lifecycle import ResizeOutcome
from elasticd.core.records import Recovery, ResizeEntry
from elasticd.scheduler.actions import SendToNode
from elasticd.scheduler.host import ResizeHost
from elasticd.scheduler.jobs import RESIZE, Job, JobState, RecoveryInFlight

log = logging.getLogger(__name__)


def infrastructure(err: dict[str, Any] | None) -> bool:
    """Whether a failure a node or the scheduler reported is the infrastructure's doing (a cause of
    elasticd/core/failures.py other than the user's): anything else -- a worker's exception, a script that
    does not load, a launch the node refused, a report with no cause -- is the job's."""
    return err is not None and is_infrastructure(err.get("cause"))


class Recoveries:
    def __init__(self, host: ResizeHost) -> None:
        self.host = host

    @staticmethod
    def recovering(job: Job) -> bool:
        return job.state is JobState.RECOVERING

    @staticmethod
    def restarting(job: Job) -> bool:
        """A torchrun-mode resize in flight: stopping the agents, or started again and not stepped yet."""
        return job.recovery is not None and job.recovery.kind == RESIZE

    @staticmethod
    def restarts_left(job: Job) -> bool:
        return job.restarts < job.spec.max_restarts

    def begin(self, job: Job, now: float, err: dict[str, Any], gone: str | None = None, completed: int = -1
              ) -> list[SendToNode]:
        """An infrastructure failure of an active job with restarts left (`restarts_left`; else the caller
        fails it, with `restart_refusal` saying why): stop what is left of it to restart it. `completed`: the
        last step an agent the failure report names completed (its beat file; the reports are throttled)."""
        assert self.restarts_left(job), job.job_id
        if self.restarting(job):   # it failed while restarting at a new size: that resize ends here
            self.close_restart(job, ResizeOutcome.FAILED, f"an agent failed: {err.get('message') or err.get('cause')}")
        cause = str(err.get("message") or err.get("cause"))
        devices = len(job.placement)
        record = Recovery(cause=cause, at=round(now, 3), from_devices=devices, devices=devices,
                          # -1: before the first step boundary (rank 0 reports steps only from there on)
                          failed_after_step=max(job.step if job.entered_steps else -1, completed),
                          # A stuck agent held the job this long before its node fenced it.
                          detected_after=float(err.get("held_s") or 0.0))
        job.recovery = RecoveryInFlight(record, kind=err.get("cause"), error=dict(err))
        job.transition(JobState.RECOVERING, now, f"{cause}; stopping the job's agents to restart it from its "
                                                  f"newest complete snapshot")
        log.warning("job %s: %s; recovering (restart %d of at most %d)", job.job_id, cause, job.restarts + 1,
                    job.spec.max_restarts)
        self.host.changed(job)
        out: list[SendToNode] = []
        for node in job.launched:
            if node != gone:
                out += self.host.kill(node, job.job_id, now, f"recovering: {cause}", force=True, hard=True)
        if gone is not None:
            self._gone(job, gone)
        return out + self.settle(job, now)

    def begin_restart(self, job: Job, placement: list[list[str]], blocks: list[int], why: str,
                      now: float) -> list[SendToNode]:
        """Resize a running torchrun-mode job by restarting it on `placement` (see the module docstring)."""
        src, dst = len(job.placement), len(placement)
        job.add_resize(ResizeEntry(src=src, dst=dst, outcome=ResizeOutcome.RESTARTING.value, at=round(now, 3),
                                   why=why, step=job.step, blocks=list(blocks)))
        cause = f"{why}: {src} -> {dst} devices"
        record = Recovery(cause=cause, at=round(now, 3), failed_after_step=job.step, from_devices=src, devices=src)
        job.recovery = RecoveryInFlight(record, kind=RESIZE, placement=[list(x) for x in placement],
                                        blocks=list(blocks))
        job.transition(JobState.RECOVERING, now, f"{cause}; stopping every agent to restart the torchrun-mode "
                                                  f"job at the new size, as torchrun does")
        log.info("job %s: %s; restarting it at the new size (torchrun mode)", job.job_id, cause)
        self.host.changed(job)
        out: list[SendToNode] = []
        for node in job.launched:
            out += self.host.kill(node, job.job_id, now, f"restarting at {dst} devices: {why}", force=True, hard=True)
        return out + self.settle(job, now)

    def _restart_target(self, job: Job, alive: set[str]) -> list[list[str]] | None:
        """A restart-resize's new devices, if every one is still the job's or free; else None (someone took
        a device of a grow while the agents stopped: the job restarts on what it had)."""
        rec = job.recovery
        assert rec is not None
        free = {(v.node_id, d) for v in self.host.free_views() for d in v.free}
        own = {(n, d) for n, d in job.placement}
        target = rec.placement
        if all(n in alive and self.host.takes_work(n) and ((n, d) in free or (n, d) in own) for n, d in target):
            return target
        return None

    @staticmethod
    def restart_refusal(job: Job, err: dict[str, Any]) -> str:
        if job.spec.portion is not None:   # its island alone cannot restart a group that spans islands
            return (f"{err.get('message') or err.get('cause')}; a portion of a job spanning islands is restarted "
                    f"with the whole job, by its federation front (job {job.spec.portion.span_id})")
        return no_restart(str(err.get("message") or err.get("cause")), job.restarts, job.spec.max_restarts)

    def report(self, job: Job, node: str, r: p.JobReport, now: float) -> list[SendToNode]:
        """A node's heartbeat about a job that is recovering."""
        rec = job.recovery
        assert rec is not None
        if r.state != "ended":
            return self.host.kill(node, job.job_id, now, f"recovering: {rec.cause}", hard=True)
        err = dict(p.flat_scalars(r.error or {})) if not r.ok else {}
        if err and not is_infrastructure(err.get("cause")):
            # A worker raised (the others lost their group after it, and may have been heard first): the job's
            # own error, which a restart would only repeat.
            err["node"] = node
            job.ended = list(dict.fromkeys([*job.ended, *rec.gone, node]))
            return self.host.end_job(job, JobState.FAILED, now, f"agent failed on {node}", error=err, gone=node)
        if err and rec.kind == Cause.PEER_LOST and err.get("cause") != Cause.PEER_LOST:
            # The first cause: the agent that died, not a survivor that noticed first.
            rec.record.cause, rec.kind, rec.error = str(err.get("message")), err.get("cause"), err
            rec.record.detected_after = float(err.get("held_s") or 0.0)
        # The last step an agent of the node completed, from its beat file: rank 0's reports come throttled.
        rec.record.failed_after_step = max([rec.record.failed_after_step, *(a.completed for a in r.agents)])
        self._gone(job, node)
        return self.settle(job, now)

    def lost(self, job: Job, node: str, now: float) -> list[SendToNode]:
        """A node of a recovering job died: its agents are gone with it."""
        self._gone(job, node)
        return self.settle(job, now)

    def _gone(self, job: Job, node: str) -> None:
        rec = job.recovery
        assert rec is not None
        if node not in rec.gone:
            rec.gone.append(node)
            self.host.changed(job)

    def settle(self, job: Job, now: float) -> list[SendToNode]:
        """Restart once no agent of the job runs anywhere."""
        rec = job.recovery
        assert rec is not None
        nodes = self.host.nodes
        alive = {n for n, nd in nodes.items() if nd.alive}
        if any(n not in rec.gone and n in alive for n in job.launched):
            return []
        job.zombies = {n: d for n, d in job.zombies.items() if n in alive and n not in job.launched}
        keep = [[n, d] for n, d in job.placement if n in alive and self.host.takes_work(n)]
        resize = rec.kind == RESIZE
        if resize:
            target = self._restart_target(job, alive)
            if target is not None:
                keep, job.blocks = target, list(rec.blocks)
            else:
                rec.record.cause += "; its new devices were taken meanwhile, so it restarts on the ones it had"
                rec.fell_back = True
        else:
            job.restarts += 1   # only a recovery counts against --max-restarts
        job.step_offset = job.step   # a torchrun-mode job's step count goes on (agent/script_main.py StepCounter)
        job.incarnation += 1
        job.restore_latest = not resize   # a torchrun-mode job has no snapshot: its checkpoint is its own
        job.restore_epoch = 0
        job.launched, job.ready, job.ended, job.agents = [], [], [], {}
        job.master_port = 0
        rec.record.devices = len(keep)
        # A restart at the size a resize asked for is placed there (a --scale-at may go below --min-devices).
        if (not resize or rec.fell_back) and len(keep) < max(1, job.spec.min_devices):
            job.placement, job.blocks = [], []
            job.transition(JobState.QUEUED, now, f"{rec.cause}; {len(keep)} of its devices left, "
                                                 f"--min-devices {job.spec.min_devices}: queued to restart from its "
                                                 f"snapshot when devices free up")
            self.host.changed(job, resched=True)
            return []
        if len(keep) != len(job.placement):   # the layout of the devices left (the same speeds: the same blocks)
            job.blocks = self.host.speeds.blocks_for(job.job_id, job.spec.workers, keep)
        job.placement = keep
        job.master_addr = nodes[keep[0][0]].host
        if job.spec.torchrun:
            job.transition(JobState.STARTING, now, f"{rec.cause}: restarting the torchrun-mode job on {len(keep)} "
                                                   f"device(s) after optimizer step {job.step}; the script starts "
                                                   f"again from its beginning (it continues where it was only if it "
                                                   f"loads its own checkpoint)")
        else:
            job.transition(JobState.STARTING, now, f"{rec.cause}; restarting on {len(keep)} device(s) from the "
                                                   f"newest complete snapshot (restart {job.restarts} of at most "
                                                   f"{job.spec.max_restarts})")
        self.host.changed(job, resched=True)
        return [self.host.launch(job, job.nodes[0])]

    def stepped(self, job: Job, r: p.JobReport, now: float) -> None:
        """Rank 0's node reports the restarted job's first step: the recovery is over; record what it cost."""
        rec = job.recovery
        if rec is not None and rec.kind == RESIZE:
            if r.step > rec.record.failed_after_step:   # the restarted script's first step (its count goes on)
                self._restarted(job, now)
            return
        if rec is None or "resumed_from" not in r.metrics:
            return
        resumed = int(r.metrics["resumed_from"])
        done = rec.record
        # Where it resumed: a restart whose start lost a node too was placed again, on fewer devices.
        done.devices = len(job.placement)
        # When its first step completed, by the agent's clock: heard of here a throttled report and a heartbeat later.
        done.resumed(resumed, float(r.metrics.get("resumed_at") or now))
        job.recoveries.append(done)
        del job.recoveries[:-100]
        job.recovery = None
        job.restore_latest = False
        self.host.changed(job)
        log.info("job %s recovered: resumed at step %d (%d redone) %.2fs after the failure", job.job_id, resumed,
                 done.steps_redone, done.seconds)

    @staticmethod
    def close_restart(job: Job, outcome: ResizeOutcome, note: str = "", seconds: float | None = None) -> None:
        """End the history entry of the restart-resize in flight."""
        entry = next((e for e in reversed(job.resizes) if e.outcome == ResizeOutcome.RESTARTING), None)
        if entry is not None:
            entry.outcome, entry.note = outcome.value, note
            entry.seconds = None if seconds is None else round(seconds, 3)

    def _restarted(self, job: Job, now: float) -> None:
        """A restart-resize's first step: its history entry gets its outcome and seconds."""
        rec = job.recovery
        assert rec is not None
        if rec.fell_back:
            self.close_restart(job, ResizeOutcome.ABORTED, rec.cause)
        else:
            self.close_restart(job, ResizeOutcome.RESTARTED, seconds=now - rec.record.at)
        job.recovery = None
        self.host.changed(job)
        log.info("job %s restarted on %d devices %.2fs after the resize began", job.job_id, len(job.placement),
                 now - rec.record.at)
