"""Live resize, the node's half: warm joiners, the go command to every agent, and what comes back.

The scheduler drives (elasticd.scheduler.resizing); a node only executes and reports, in its
heartbeats, what the scheduler needs to take the next step:
- `PrepareResize`: start this node's joining ranks as warm standby agents (`--standby`: the script is
  loaded and torch warmed up, then they wait), or take them from the job's agents kept warm since a
  shrink (below); and on the node hosting rank 0 pick the rendezvous port of the new group. The job's
  running agents are not touched.
- `ResizeJob` (go): tell the running agents `resize` (they vote at the next step boundary, all stop at
  the same step and hand their state over) and the joiners `join`. Agents whose rank is beyond the
  new size leave: they move to `NodeJob.retired`, exit 0 after the hand-over, and their device is
  free once they are gone. When the job's --scale-at schedule grows again later (`ResizeJob.standby`),
  they move to `NodeJob.warm` instead and stay, their devices free: a process that has run the job's
  steps joins that grow sooner than one started for it, as under `elasticd run`.
- `AbortResize`: the resize is called off before the go (the joiners are sent away), or after it because
  the agents refused it: they found a state they cannot carry at the step boundary and train on at the
  old size (agent/slicer/boundary.py). Then the go's changes here are undone too: the leavers and the
  renumbered stayers of a drain are the job's agents under their old ranks again.

A joiner that dies before the go does not fail the job (it never joined it): the node reports a
`resize_error` and the scheduler calls the resize off. If the job's own agents all end while joiners
are still waiting (the job finished before the resize could happen), the joiners are sent away and
the job ends normally. The resize snapshots the agents save here for falling back
(agent/resize/fallback.py) are dropped once a step completed after the resize.

`NodeResizes` is pure, like the core that holds it (elasticd.daemon.supervision): the core owns the job
table and hands it the job a command or event is about; it answers with actions (elasticd.daemon.actions)
and never starts, signals or deletes anything itself.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from elasticd import protocol as p
from elasticd.daemon.actions import Action, DropSnapshots, Report, SendToAgent, Signal, Spawn
from elasticd.daemon.records import Agent, NodeJob

log = logging.getLogger(__name__)

DROP_GRACE_S = 3.0   # SIGTERM -> SIGKILL for a joiner sent away


class NodeResizes:
    """The node's resize steps over the jobs the supervision core hands it."""

    def __init__(self, devices: Mapping[str, p.DeviceInfo]) -> None:
        self.devices = devices

    def prepare(self, job: NodeJob, msg: p.PrepareResize, port: int) -> list[Action]:
        """Spawn the joiners of resize `msg.epoch` (a repeated prepare does nothing); `port`: the
        rendezvous port picked for the new group, used when `msg.pick_port`."""
        if job.resize_epoch == msg.epoch:
            return []
        job.resize_epoch, job.resize_error, job.resize_port, job.before_go = msg.epoch, None, 0, None
        if msg.pick_port:
            job.resize_port = port
        out: list[Action] = []
        taken = {rank for rank, a in job.agents.items() if a.exitcode is None}
        warm = [a for a in job.warm if a.exitcode is None and a.identity is not None and a.left]
        reused = []
        for pl in msg.joiners:
            if pl.device_id not in self.devices or pl.rank in taken:
                why = "no such device" if pl.device_id not in self.devices else "rank still taken"
                job.resize_error = {"message": f"cannot start joining agent {pl.rank} on {pl.device_id}: {why}"}
                log.error("job %s resize %d: %s", msg.job_id, msg.epoch, job.resize_error["message"])
                break
            taken.add(pl.rank)
            if warm:
                reused.append(self._rejoin(job, warm.pop(0), pl))
                continue
            out.append(Spawn(job.launch, pl.rank, msg.devices, pl.device_id, f"rank{pl.rank}-e{msg.epoch}.json",
                             standby=True, blocks=list(msg.blocks), hold_at=list(msg.hold_at)))
        log.info("job %s resize %d (%d -> %d): joiners %s starting%s%s", msg.job_id, msg.epoch, msg.devices_from,
                 msg.devices, [pl.rank for pl in msg.joiners],
                 f" ({len(reused)} from agents kept warm: {reused})" if reused else "",
                 f"; rendezvous port {job.resize_port}" if job.resize_port else "")
        return out + ([Report()] if reused else [])   # ready already: the scheduler may go at once

    def _rejoin(self, job: NodeJob, agent: Agent, pl: p.RankPlacement) -> int:
        """An agent kept warm since a shrink becomes the joiner of rank `pl.rank` on `pl.device_id`; it
        takes its new rank and device with the join command (`go`). Returns its pid."""
        job.warm.remove(agent)
        agent.former_rank, agent.rank = agent.rank, pl.rank   # its messages carry the old rank until it joins
        agent.device = self.devices[pl.device_id]
        agent.warm = agent.left = agent.done = False
        agent.standby = True
        agent.metrics, agent.step_times, agent.timing, agent.timing_acc = {}, [], {}, {}
        job.agents[pl.rank] = agent
        return agent.pid

    def joiner_not_started(self, job: NodeJob, spawn: Spawn, reason: str) -> list[Action]:
        """A joiner's process could not be started: the resize cannot happen, the job goes on."""
        job.resize_error = {"message": f"cannot start joining agent {spawn.rank}: {reason}"}
        log.error("job %s resize %d: %s", job.job_id, job.resize_epoch, job.resize_error["message"])
        return []

    def go(self, job: NodeJob, msg: p.ResizeJob) -> list[Action]:
        """The commands for this node's agents: `resize` for the running ones, `join` for the joiners."""
        job.resize_epoch, job.resize_error = msg.epoch, None   # an older resize's refusal is not this one's
        job.before_go = dict(job.agents)
        resize = p.AgentResize(epoch=msg.epoch, world=msg.devices, master_addr=msg.master_addr,
                               master_port=msg.master_port, keep=list(msg.keep), blocks=list(msg.blocks),
                               standby=msg.standby and not msg.keep, islands=list(msg.islands))
        out: list[Action] = []
        if msg.keep:   # a drain's shrink: every agent here hears it, then the stayers take their new ranks
            out = [SendToAgent(a.identity, resize) for a in job.agents.values()
                   if a.exitcode is None and a.identity is not None and not a.pending]
            job.renumber(list(msg.keep))
            log.info("job %s resize %d: %d agents here told to re-form as %d keeping old ranks %s at %s:%d",
                     msg.job_id, msg.epoch, len(out), msg.devices, list(msg.keep), msg.master_addr, msg.master_port)
            return out
        for rank, a in sorted(job.agents.items()):
            if a.exitcode is not None:
                continue
            if a.identity is None:   # cannot happen after the scheduler's checks; the deadline catches it
                log.error("job %s resize %d: agent %d is not connected", msg.job_id, msg.epoch, rank)
                continue
            if a.standby:
                a.standby, a.joining = False, True
                out.append(SendToAgent(a.identity, p.AgentJoin(rank=rank, world=msg.devices, join_from=msg.devices_from,
                                                        master_addr=msg.master_addr, master_port=msg.master_port,
                                                        device_index=a.device.index, islands=list(msg.islands))))
            else:
                out.append(SendToAgent(a.identity, resize))
                if rank >= msg.devices and resize.standby:   # leaves, and stays for the coming grow
                    job.keep_warm(a)
                elif rank >= msg.devices:   # leaves after handing its workers over
                    job.retire(a)
        log.info("job %s resize %d: %d agents here told to re-form as %d at %s:%d", msg.job_id, msg.epoch, len(out),
                 msg.devices, msg.master_addr, msg.master_port)
        return out

    def abort(self, job: NodeJob, msg: p.AbortResize, now: float) -> list[Action]:
        if job.before_go is not None and msg.epoch == job.resize_epoch:
            self._undo_go(job)
        dropped = [a for a in job.agents.values() if a.pending]
        out = [x for a in dropped for x in self._send_away(job, a, now)]
        log.info("job %s resize %d called off (%s): joiners %s sent away", msg.job_id, msg.epoch, msg.reason,
                 [a.rank for a in dropped])
        return out

    @staticmethod
    def _undo_go(job: NodeJob) -> None:
        """The agents refused the resize: its leavers stay, a drain's stayers keep their old ranks."""
        before, job.before_go = job.before_go, None
        assert before is not None
        for rank, a in before.items():
            if a in job.retired and not a.dropped:
                job.retired.remove(a)
            if a in job.warm:
                job.warm.remove(a)
                a.warm = False
            a.rank, a.former_rank = rank, None
        job.agents = {rank: a for rank, a in before.items() if not a.dropped}

    def refused(self, job: NodeJob, agent: Agent, info: p.RefusedInfo) -> list[Action]:
        """The agents refused the resize at a step boundary and train on (each says so): the scheduler
        hears it in the next report and calls the resize off (`abort`)."""
        if job.resize_error is None:
            job.resize_error = {"message": info.message or "a state could not be captured",
                                "refused": True, "step": info.step}
            log.warning("job %s resize %d refused by its agents after step %s: %s", job.job_id, job.resize_epoch,
                        info.step, job.resize_error["message"])
        return [Report()]

    def resized(self, job: NodeJob, agent: Agent, resized: p.ResizedInfo) -> list[Action]:
        # A joiner does not know the epoch it joined (agent.process `_join`); this node does.
        agent.epoch = resized.epoch if resized.epoch is not None else job.resize_epoch
        agent.left = resized.left
        agent.joining = False
        agent.former_rank = None   # it speaks as its new rank from now on (agent.process `_relayout`)
        job.before_go = None       # the hand-over happened: nothing to put back
        info = dataclasses.replace(resized, epoch=agent.epoch)
        if agent.left:
            log.info("job %s: agent %d left in resize %d", job.job_id, agent.rank, agent.epoch)
        elif job.agents and agent is job.lead():
            job.resizes.append(info)
            del job.resizes[:-100]
        return [Report()]

    def stepped(self, job: NodeJob, agent: Agent) -> list[Action]:
        """An agent completed a step: the first at the new size ends a resize (tell at once)."""
        if agent.epoch > agent.stepped:
            agent.stepped = agent.epoch
            # A step at the new size ran a collective with every agent: nothing falls back to the
            # snapshot of this resize any more (nor of an older one).
            return [Report(), DropSnapshots(job.job_id, agent.epoch, under_key=job.launch.snapshot_key)]
        if job.launch.restore_epoch and not job.restored:
            job.restored = True   # the same, for the snapshot this launch started from
            return [DropSnapshots(job.job_id, job.launch.restore_epoch, under_key=job.launch.snapshot_key)]
        return []

    def joiner_died(self, job: NodeJob, agent: Agent, code: int, error: dict[str, Any]) -> list[Action]:
        """A joiner exited before the hand-over: the resize is off, the job goes on without it."""
        agent.dropped = True
        job.retire(agent)
        if job.resize_error is None:
            job.resize_error = {**error, "rank": agent.rank}
        log.warning("job %s resize %d: joining agent %d exited with code %d before the hand-over", job.job_id,
                    job.resize_epoch, agent.rank, code)
        return [Report()]

    def expire(self, job: NodeJob, now: float) -> list[Action]:
        """SIGKILL the joiners sent away that did not go within their grace."""
        out: list[Action] = []
        for a in job.retired:
            if a.exitcode is None and a.kill_at is not None and now >= a.kill_at:
                a.kill_at = None
                out.append(Signal(a.pid, "KILL"))
        return out

    def after_exits(self, job: NodeJob, now: float) -> list[Action]:
        """Send joiners away once the job's own agents here have all ended; forget retired agents that are
        gone (the scheduler frees a device as soon as no live agent is reported on it)."""
        out: list[Action] = []
        members = [a for a in job.everyone() if not a.pending and not a.dropped and not a.warm]
        pending = [a for a in [*job.agents.values(), *job.warm] if (a.pending or a.warm) and a.exitcode is None]
        if pending and members and all(a.exitcode is not None for a in members):
            log.info("job %s: its agents here ended before resize %d; joiners %s sent away", job.job_id,
                     job.resize_epoch, [a.rank for a in pending])
            for a in pending:
                out += self._send_away(job, a, now)
        gone = [a for a in [*job.retired, *job.warm] if a.exitcode is not None]
        if gone:
            job.retired = [a for a in job.retired if a.exitcode is None]
            job.warm = [a for a in job.warm if a.exitcode is None]
            out.append(Report())
        return out

    def _send_away(self, job: NodeJob, agent: Agent, now: float) -> list[Action]:
        """A joiner of a resize called off, or an agent kept warm for a grow that will not come."""
        agent.dropped = True
        agent.standby = agent.joining = False
        job.retire(agent)
        # A standby agent has no state to save: SIGTERM at once, SIGKILL if it does not go.
        agent.kill_at = now + DROP_GRACE_S
        return [Signal(agent.pid, "TERM"), Report()]
