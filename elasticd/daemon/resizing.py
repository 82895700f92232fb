"""Live resize, the node's half: warm joiners, the go command to every agent, and what comes back.

The scheduler drives (elasticd.scheduler.resizing); a node only executes and reports, in its
heartbeats, what the scheduler needs to take the next step:
- `PrepareResize`: start this node's joining ranks as warm standby agents (`--standby`: the script is
  loaded and torch warmed up, then they wait), and on the node hosting rank 0 pick the rendezvous
  port of the new group. The job's running agents are not touched.
- `ResizeJob` (go): tell the running agents `resize` (they vote at the next step boundary, all stop at
  the same step and hand their state over) and the joiners `join`. Agents whose rank is beyond the
  new size leave: they move to `LocalJob.retired`, exit 0 after the hand-over, and their device is
  free once they are gone.
- `AbortResize`: the resize is called off before the go; the joiners are sent away.

A joiner that dies before the go does not fail the job (it never joined it): the node reports a
`resize_error` and the scheduler calls the resize off. If the job's own agents all end while joiners
are still waiting (the job finished before the resize could happen), the joiners are sent away and
the job ends normally.
"""

from __future__ import annotations

import logging
import shutil
import signal
from typing import TYPE_CHECKING, Any

from elasticd import protocol as p
from elasticd.agent.resize import parts as saved_parts

if TYPE_CHECKING:
    from elasticd.daemon.agents import Agent, LocalJob
    from elasticd.daemon.statedir import StateDir

log = logging.getLogger(__name__)

DROP_GRACE_S = 3.0   # SIGTERM -> SIGKILL for a joiner sent away


class NodeResizes:
    """The resize half of `Supervisor` (a mixin: it shares the job table and the spawning)."""

    if TYPE_CHECKING:   # provided by Supervisor
        jobs: dict[str, LocalJob]
        devices: dict[str, p.DeviceInfo]
        sd: StateDir
        host: str
        changed: bool

        def _start_agent(self, job: LocalJob, rank: int, world: int, device_id: str, error_name: str, *,
                         master_addr: str = "", master_port: int = 0, standby: bool = False) -> Agent: ...

        def _drop(self, job: LocalJob) -> None: ...

        def _error_of(self, agent: Agent, code: int) -> dict[str, Any]: ...

    def prepare(self, msg: p.PrepareResize, now: float) -> None:
        from elasticd.daemon.agents import LocalJob
        from elasticd.ports import free_port

        job = self.jobs.get(msg.job_id)
        if job is None or (job.state == "ended" and not job.agents):
            if job is not None:
                self._drop(job)
            launch = p.LaunchJob(job_id=msg.job_id, script=msg.script, func=msg.func, workers=msg.workers,
                                 world=msg.world, placements=[], master_addr="", master_port=0, cwd=msg.cwd,
                                 env=msg.env)
            job = LocalJob(msg.job_id, launch, 0)
            self.jobs[msg.job_id] = job
        if job.resize_epoch == msg.epoch:
            return   # a repeated prepare
        job.resize_epoch, job.resize_error, job.resize_port = msg.epoch, None, 0
        if msg.pick_port:
            job.resize_port = free_port(self.host)
        for pl in msg.joiners:
            old = job.agents.get(pl.rank)
            if pl.device_id not in self.devices or (old is not None and old.exitcode is None):
                why = "no such device" if pl.device_id not in self.devices else "rank still taken"
                job.resize_error = {"message": f"cannot start joining agent {pl.rank} on {pl.device_id}: {why}"}
                break
            try:
                agent = self._start_agent(job, pl.rank, msg.world, pl.device_id, f"rank{pl.rank}-e{msg.epoch}.json",
                                          standby=True)
            except (OSError, ValueError) as e:
                job.resize_error = {"message": f"cannot start joining agent {pl.rank}: {e}"}
                break
            job.agents[pl.rank] = agent
        if job.resize_error is not None:
            log.error("job %s resize %d: %s", msg.job_id, msg.epoch, job.resize_error["message"])
        log.info("job %s resize %d (%d -> %d): joiners %s starting%s", msg.job_id, msg.epoch, msg.world_from,
                 msg.world, [pl.rank for pl in msg.joiners],
                 f"; rendezvous port {job.resize_port}" if job.resize_port else "")

    def go(self, msg: p.ResizeJob) -> list[tuple[bytes, p.Message]]:
        """The commands for this node's agents: `resize` for the running ones, `join` for the joiners."""
        job = self.jobs.get(msg.job_id)
        if job is None:
            return []
        job.resize_epoch = msg.epoch
        resize = p.AgentResize(epoch=msg.epoch, world=msg.devices, master_addr=msg.master_addr,
                               master_port=msg.master_port)
        out: list[tuple[bytes, p.Message]] = []
        for rank, a in sorted(job.agents.items()):
            if a.exitcode is not None:
                continue
            if a.identity is None:   # cannot happen after the scheduler's checks; the deadline catches it
                log.error("job %s resize %d: agent %d is not connected", msg.job_id, msg.epoch, rank)
                continue
            if a.standby:
                a.standby, a.joining = False, True
                out.append((a.identity, p.AgentJoin(rank=rank, world=msg.devices, join_from=msg.world_from,
                                                    master_addr=msg.master_addr, master_port=msg.master_port)))
            else:
                out.append((a.identity, resize))
                if rank >= msg.devices:
                    job.retire(a)   # leaves after handing its workers over
        log.info("job %s resize %d: %d agents here told to re-form as %d at %s:%d", msg.job_id, msg.epoch, len(out),
                 msg.devices, msg.master_addr, msg.master_port)
        return out

    def abort(self, msg: p.AbortResize, now: float) -> None:
        job = self.jobs.get(msg.job_id)
        if job is None:
            return
        dropped = [a for a in job.agents.values() if a.pending]
        for a in dropped:
            self._send_away(job, a, now)
        log.info("job %s resize %d called off (%s): joiners %s sent away", msg.job_id, msg.epoch, msg.reason,
                 [a.rank for a in dropped])

    def resized(self, job: LocalJob, agent: Agent, info: dict[str, Any]) -> None:
        epoch = info.get("epoch")
        # A joiner does not know the epoch it joined (agent.process `_join`); this node does.
        agent.epoch = epoch if isinstance(epoch, int) and not isinstance(epoch, bool) else job.resize_epoch
        agent.left = bool(info.get("left"))
        agent.joining = False
        info = {**info, "epoch": agent.epoch}
        if agent.left:
            log.info("job %s: agent %d left in resize %d", job.job_id, agent.rank, agent.epoch)
        elif job.agents and agent is job.lead():
            job.resizes.append(info)
            del job.resizes[:-100]
        self.changed = True

    def joiner_died(self, job: LocalJob, agent: Agent, code: int) -> None:
        """A joiner exited before the hand-over: the resize is off, the job goes on without it."""
        agent.dropped = True
        job.retire(agent)
        if job.resize_error is None:
            job.resize_error = {**self._error_of(agent, code), "rank": agent.rank}
        log.warning("job %s resize %d: joining agent %d exited with code %d before the hand-over", job.job_id,
                    job.resize_epoch, agent.rank, code)
        self.changed = True

    def after_exits(self, job: LocalJob, now: float) -> bool:
        """Send joiners away once the job's own agents here have all ended; forget retired agents that are
        gone (the scheduler frees a device as soon as no live agent is reported on it). True if changed."""
        changed = False
        members = [a for a in job.everyone() if not a.pending and not a.dropped]
        pending = [a for a in job.agents.values() if a.pending and a.exitcode is None]
        if pending and members and all(a.exitcode is not None for a in members):
            log.info("job %s: its agents here ended before resize %d; joiners %s sent away", job.job_id,
                     job.resize_epoch, [a.rank for a in pending])
            for a in pending:
                self._send_away(job, a, now)
            changed = True
        gone = [a for a in job.retired if a.exitcode is not None]
        if gone:
            job.retired = [a for a in job.retired if a.exitcode is None]
            changed = True
        return changed

    # --- the snapshots kept for falling back (agent/resize/fallback.py) ----------------------------------------

    def snapshot_parts(self, job: LocalJob) -> tuple[int, list[int]]:
        """The newest resize snapshot the job's agents saved here, and its parts (for the scheduler)."""
        root = self.sd.snapshot_dir(job.job_id)
        epochs = saved_parts.epochs(root)
        if not epochs:
            return 0, []
        return epochs[-1], saved_parts.parts(root, epochs[-1])

    def drop_snapshots(self, job: LocalJob, upto: int) -> None:
        root = self.sd.snapshot_dir(job.job_id)
        for epoch in saved_parts.epochs(root):
            if epoch <= upto:
                shutil.rmtree(saved_parts.epoch_dir(root, epoch), ignore_errors=True)
                log.info("job %s: snapshot of resize %d dropped (a step completed after it)", job.job_id, epoch)

    def _send_away(self, job: LocalJob, agent: Agent, now: float) -> None:
        from elasticd.daemon.agents import _signal_group

        agent.dropped = True
        agent.standby = agent.joining = False
        job.retire(agent)
        # A standby agent has no state to save: SIGTERM at once, SIGKILL if it does not go.
        _signal_group(agent.popen.pid, signal.SIGTERM)
        agent.kill_at = now + DROP_GRACE_S
        self.changed = True
