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

`Recoveries` is the shell that carries this out against the scheduler's tables, as `Rollbacks` does for
failed resizes; it sees the state only as a `ResizeHost`.
"""

from __future__ import annotations

import logging
from typing import Any

from elasticd import protocol as p
from elasticd.core.records import Recovery
from elasticd.scheduler.actions import SendToNode
from elasticd.scheduler.host import ResizeHost
from elasticd.scheduler.jobs import Job, JobState

log = logging.getLogger(__name__)

# What a node says about an agent that failed (elasticd/daemon/processes.py, agent/process.py): only these are
# the infrastructure's doing. Anything else -- a worker's exception, a script that does not load, a
# launch the node refused -- is the job's, and retrying it would fail the same way.
INFRASTRUCTURE = ("died", "peer_lost", "node_lost", "drained")


def infrastructure(err: dict[str, Any] | None) -> bool:
    return err is not None and err.get("cause") in INFRASTRUCTURE


class Recoveries:
    def __init__(self, host: ResizeHost) -> None:
        self.host = host

    @staticmethod
    def recovering(job: Job) -> bool:
        return job.state is JobState.RECOVERING

    @staticmethod
    def restarts_left(job: Job) -> bool:
        return job.restarts < job.spec.max_restarts

    def begin(self, job: Job, now: float, err: dict[str, Any], gone: str | None = None) -> list[SendToNode]:
        """An infrastructure failure of an active job with restarts left (`restarts_left`; else the caller
        fails it, with `restart_refusal` saying why): stop what is left of it to restart it."""
        assert self.restarts_left(job), job.job_id
        cause = str(err.get("message") or err.get("cause"))
        job.recovery = {"cause": cause, "kind": err.get("cause"), "at": round(now, 3),
                        # -1: before the first step boundary (rank 0 reports steps only from there on)
                        "failed_after_step": job.step if job.entered_steps else -1,
                        "from_devices": len(job.placement), "gone": [], "error": dict(err)}
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

    @staticmethod
    def restart_refusal(job: Job, err: dict[str, Any]) -> str:
        return (f"{err.get('message') or err.get('cause')}; not restarting: {job.restarts} restart(s) of "
                f"--max-restarts {job.spec.max_restarts} used")

    def report(self, job: Job, node: str, r: p.JobReport, now: float) -> list[SendToNode]:
        """A node's heartbeat about a job that is recovering."""
        rec = job.recovery
        assert rec is not None
        if r.state != "ended":
            return self.host.kill(node, job.job_id, now, f"recovering: {rec['cause']}", hard=True)
        err = dict(p.flat_scalars(r.error or {})) if not r.ok else {}
        if err and err.get("cause") not in INFRASTRUCTURE:
            # A worker raised (the others lost their group after it, and may have been heard first): the job's
            # own error, which a restart would only repeat.
            err["node"] = node
            job.ended = list(dict.fromkeys([*job.ended, *rec["gone"], node]))
            return self.host.end_job(job, JobState.FAILED, now, f"agent failed on {node}", error=err, gone=node)
        if err and rec.get("kind") == "peer_lost" and err.get("cause") != "peer_lost":
            # The first cause: the agent that died, not a survivor that noticed first.
            rec.update(cause=str(err.get("message")), kind=err.get("cause"), error=err)
        self._gone(job, node)
        return self.settle(job, now)

    def lost(self, job: Job, node: str, now: float) -> list[SendToNode]:
        """A node of a recovering job died: its agents are gone with it."""
        self._gone(job, node)
        return self.settle(job, now)

    def _gone(self, job: Job, node: str) -> None:
        rec = job.recovery
        assert rec is not None
        if node not in rec["gone"]:
            rec["gone"].append(node)
            self.host.changed(job)

    def settle(self, job: Job, now: float) -> list[SendToNode]:
        """Restart once no agent of the job runs anywhere."""
        rec = job.recovery
        assert rec is not None
        nodes = self.host.nodes
        alive = {n for n, nd in nodes.items() if nd.alive}
        if any(n not in rec["gone"] and n in alive for n in job.launched):
            return []
        job.zombies = {n: d for n, d in job.zombies.items() if n in alive and n not in job.launched}
        keep = [[n, d] for n, d in job.placement if n in alive and self.host.takes_work(n)]
        job.restarts += 1
        job.incarnation += 1
        job.restore_latest = True
        job.restore_epoch = 0
        job.launched, job.ready, job.ended, job.agents = [], [], [], {}
        job.master_port = 0
        rec["devices"] = len(keep)
        if len(keep) < max(1, job.spec.min_devices):
            job.placement, job.blocks = [], []
            job.transition(JobState.QUEUED, now, f"{rec['cause']}; {len(keep)} of its devices left, "
                                                 f"--min-devices {job.spec.min_devices}: queued to restart from its "
                                                 f"snapshot when devices free up")
            self.host.changed(job, resched=True)
            return []
        if len(keep) != len(job.placement):   # the layout of the devices left (the same speeds: the same blocks)
            job.blocks = self.host.speeds.blocks_for(job.job_id, job.spec.workers, keep)
        job.placement = keep
        job.master_addr = nodes[keep[0][0]].host
        job.transition(JobState.STARTING, now, f"{rec['cause']}; restarting on {len(keep)} devices from its newest "
                                               f"complete snapshot (restart {job.restarts} of at most "
                                               f"{job.spec.max_restarts})")
        self.host.changed(job, resched=True)
        return [self.host.launch(job, job.nodes[0])]

    def stepped(self, job: Job, r: p.JobReport, now: float) -> None:
        """Rank 0's node reports the restarted job's first step: the recovery is over; record what it cost."""
        rec = job.recovery
        if rec is None or "resumed_from" not in r.metrics:
            return
        resumed = int(r.metrics["resumed_from"])
        done = Recovery(**{k: rec[k] for k in ("cause", "at", "failed_after_step", "from_devices", "devices")})
        done.resumed(resumed, now)
        job.recoveries.append(done.to_dict())
        del job.recoveries[:-100]
        job.recovery = None
        job.restore_latest = False
        self.host.changed(job)
        log.info("job %s recovered: resumed at step %d (%d redone) %.2fs after the failure", job.job_id, resumed,
                 done.steps_redone, done.seconds)
