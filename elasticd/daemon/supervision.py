"""The node daemon's agent supervision as a pure state machine: events in, actions out.

Events are the scheduler's commands (launch, kill, forget, prepare/go/abort a resize), what the I/O
shell saw of the agents' processes (started, could not start, exited, resource usage), the agents'
own control messages (hello, step, failed, resized, done) and clock ticks; `now` is always passed in.
What comes out is a list of actions (elasticd.daemon.actions): spawn an agent, signal a process group,
send a command to an agent, report to the scheduler now, drop snapshot files. No processes, signals,
sockets or files in here: elasticd.daemon.processes executes the actions, so tests drive this core by hand
(tests/elasticd/daemon/test_daemon_supervision.py), as the scheduler's core (elasticd.scheduler.state) is driven.

Liveness comes from the process table (the shell reports exits), not from the agents' messages: a
hung or SIGKILLed agent is still seen. Progress (step, loss) comes from the agents' messages.

Stopping escalates: a stop command on the control socket (the runtime stops at its next step
boundary), then SIGTERM to the agent's process group, then SIGKILL. When one local agent of a job
fails, its siblings are terminated at once: they would otherwise wait forever on a collective.

The resize steps live in `NodeResizes` (elasticd.daemon.resizing), which this core holds and hands the
job each resize command or event is about.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Mapping
from typing import Any

from elasticd import protocol as p
from elasticd.core.failures import Cause
from elasticd.core.timing import clean_timing, merge_timing
from elasticd.core.watchdog import Beat
from elasticd.daemon.actions import Action, DropSnapshots, Report, SendToAgent, Signal, Spawn
from elasticd.daemon.records import Agent, NodeJob
from elasticd.daemon.resizing import NodeResizes

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0     # after a stop command, before SIGTERM
# What a heartbeat's job reports may take: the frame cap less room for the envelope and the device table.
HEARTBEAT_BUDGET = p.MAX_FRAME_BYTES - (128 << 10)
CUT_TEXT_CHARS = 2048  # of an error's message and traceback, in a report cut to fit
TERM_GRACE_S = 3.0     # after SIGTERM, before SIGKILL


class Supervision:
    """This node's agents, by job. Not thread-safe: the daemon's loop owns it."""

    def __init__(self, devices: list[p.DeviceInfo]) -> None:
        self.devices = {d.device_id: d for d in devices}
        self.jobs: dict[str, NodeJob] = {}
        self.resizes = NodeResizes(self.devices)
        self._by_identity: dict[bytes, tuple[str, Agent]] = {}
        self._by_pid: dict[int, tuple[str, Agent]] = {}   # agents whose exit was not reported yet
        self._cut_warned: set[str] = set()   # jobs whose reports were cut to fit a heartbeat (warned once)

    # --- commands from the scheduler -------------------------------------------------------------

    def launch(self, msg: p.LaunchJob, port: int) -> list[Action]:
        """Spawn this node's agents of a job (idempotent); `port`: the rendezvous port to use when the
        launch names none. A refused launch leaves its reason in the job's `error`."""
        old = self.jobs.get(msg.job_id)
        if old is not None and old.state != "ended":
            log.info("job %s: launch repeated while its agents run; ignored", msg.job_id)
            return []
        if old is not None:
            self._drop(old)
        unknown = [pl.device_id for pl in msg.placements if pl.device_id not in self.devices]
        job = NodeJob(msg.job_id, msg, msg.master_port or port)
        self.jobs[msg.job_id] = job
        if unknown or not msg.placements:
            job.error = {"message": f"node has no device(s) {unknown}" if unknown else "launch without ranks"}
            log.error("job %s: %s", msg.job_id, job.error["message"])
            return []
        log.info("job %s: launching ranks %s (world %d, rendezvous %s:%d)", msg.job_id,
                 [pl.rank for pl in msg.placements], msg.devices, msg.master_addr, job.master_port)
        return [Spawn(msg, pl.rank, msg.devices, pl.device_id, f"rank{pl.rank}.json", master_addr=msg.master_addr,
                      master_port=job.master_port, restore_epoch=msg.restore_epoch,
                      restore_latest=msg.restore_latest, blocks=list(msg.blocks), hold_at=list(msg.hold_at))
                for pl in msg.placements]

    def kill(self, job_id: str, reason: str, now: float, graceful: bool = True) -> list[Action]:
        """Start stopping a job's agents: stop commands to those connected, signals later (or now)."""
        job = self.jobs.get(job_id)
        if job is None or job.state == "ended":
            return []
        if job.killing is None:
            job.killing = reason
            log.info("job %s: stopping agents (%s)", job_id, reason)
        if not graceful:
            if job.term_at != float("inf"):  # not already past SIGTERM
                job.term_at = now
                return self._escalate(job, now)
            return []
        if job.term_at is not None:
            return []
        job.term_at = now + STOP_GRACE_S
        return [SendToAgent(a.identity, p.AgentStop()) for a in job.everyone()
                if a.identity is not None and a.exitcode is None]

    def forget(self, job_ids: list[str]) -> list[Action]:
        out: list[Action] = []
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is not None and job.state == "ended":
                self._drop(job)
                # Over for the scheduler: no relaunch will restore from what its agents saved here. A portion of
                # a job spanning islands that did not finish keeps its periodic snapshots for the job's restart.
                finished = job.error is None and job.killing is None
                out.append(DropSnapshots(job_id, None, job.launch.snapshot_key if finished else ""))
        return out

    def prepare(self, msg: p.PrepareResize, port: int) -> list[Action]:
        """Start the joiners of a resize; `port`: the new group's rendezvous port if `msg.pick_port`."""
        job = self.jobs.get(msg.job_id)
        if job is None or (job.state == "ended" and not job.agents):
            if job is not None:
                self._drop(job)
            launch = p.LaunchJob(job_id=msg.job_id, script=msg.script, func=msg.func, workers=msg.workers,
                                 devices=msg.devices, placements=[], master_addr="", master_port=0, cwd=msg.cwd,
                                 env=msg.env, snapshot_every=msg.snapshot_every, stuck_after=msg.stuck_after,
                                 run_as=msg.run_as, threads=msg.threads, device_memory=msg.device_memory,
                                 snapshot_key=msg.snapshot_key)
            job = NodeJob(msg.job_id, launch, 0)
            self.jobs[msg.job_id] = job
        return self.resizes.prepare(job, msg, port)

    def go(self, msg: p.ResizeJob) -> list[Action]:
        job = self.jobs.get(msg.job_id)
        return [] if job is None else self.resizes.go(job, msg)

    def abort(self, msg: p.AbortResize, now: float) -> list[Action]:
        job = self.jobs.get(msg.job_id)
        return [] if job is None else self.resizes.abort(job, msg, now)

    # --- what the shell saw of the processes -----------------------------------------------------

    def started(self, spawn: Spawn, pid: int, token: str) -> None:
        """The process of `spawn` runs as `pid`, holding `token` (its proof on the agent socket)."""
        job = self.jobs[spawn.job_id]
        agent = Agent(spawn.rank, self.devices[spawn.device_id], pid, token=token, standby=spawn.standby)
        job.agents[spawn.rank] = agent
        self._by_pid[pid] = (job.job_id, agent)

    def spawn_failed(self, spawn: Spawn, reason: str, now: float) -> list[Action]:
        """The process of `spawn` could not be started; the shell starts no more of its batch."""
        job = self.jobs.get(spawn.job_id)
        if job is None:
            return []
        if spawn.standby:
            return self.resizes.joiner_not_started(job, spawn, reason)
        job.error = {"message": f"cannot start agent {spawn.rank}: {reason}"}
        log.error("job %s: %s", job.job_id, job.error["message"])
        return self.kill(job.job_id, "a sibling agent could not start", now, graceful=False)

    def exited(self, pid: int, code: int, error: dict[str, Any], now: float) -> list[Action]:
        """Agent `pid` exited with `code`; `error`: its error report (or one made up from its log tail),
        used only when the exit is a failure."""
        where = self._by_pid.pop(pid, None)
        job = self.jobs.get(where[0]) if where else None
        if where is None or job is None:
            return []
        agent = where[1]
        before = job.state
        agent.exitcode = code
        self._by_identity.pop(agent.identity or b"", None)
        level = logging.INFO if code == 0 or agent.dropped else logging.WARNING
        log.log(level, "job %s: agent %d (pid %d) exited with code %d%s", job.job_id, agent.rank, pid, code,
                " (left in a resize)" if agent.left else " (joiner sent away)" if agent.dropped else "")
        out: list[Action] = []
        if agent.dropped or agent.left:
            pass
        elif agent.standby:
            out += self.resizes.joiner_died(job, agent, code, error)
        elif code != 0 and job.killing is None:
            # A survivor's report of its lost group may have arrived (AgentFailed) before this death was reaped.
            if job.error is None or _first_cause(job, error, code):
                job.error = dict(error)
            job.error.setdefault("rank", agent.rank)
            out += self.kill(job.job_id, f"agent {agent.rank} failed", now, graceful=False)
        elif code != 0 and _first_cause(job, error, code):
            job.error = {**error, "rank": agent.rank}
        if job.state != before:
            out.append(Report())
        return out

    def sampled(self, pid: int, rss: int, cpu: float) -> None:
        """Agent `pid` uses this much memory and CPU (reported for the job's own agents, not retired ones)."""
        where = self._by_pid.get(pid)
        job = self.jobs.get(where[0]) if where else None
        if where is not None and job is not None and job.agents.get(where[1].rank) is where[1]:
            where[1].rss, where[1].cpu = rss, cpu

    def watched(self, pid: int, now: float, stopped: bool, beat: Beat | None) -> None:
        """What was read of agent `pid` for the watchdog: whether its process is stopped, and its beat file
        (also read once more when it exits, before `exited`: the last step it completed)."""
        where = self._by_pid.get(pid)
        job = self.jobs.get(where[0]) if where else None
        if where is None or job is None:
            return
        if beat is not None:
            where[1].completed = max(where[1].completed, beat.step)
        if job.agents.get(where[1].rank) is where[1]:
            job.watchdog.observe(pid, now, stopped, beat)

    def tick(self, now: float, watched: bool = True) -> list[Action]:
        """Timers: escalate stops, SIGKILL joiners that would not go, follow up on exits, fence stuck agents
        (`watched`: the agents were read for the watchdog just now; its verdict follows each reading, as
        `elasticd run`'s does, so a stopped agent is judged by what was read of it, not between readings)."""
        out: list[Action] = []
        for job in list(self.jobs.values()):
            out += self.resizes.expire(job, now)
            out += self.resizes.after_exits(job, now)
            out += self._escalate(job, now)
            if watched:
                out += self._fence(job, now)
        return out

    # --- messages from agents --------------------------------------------------------------------

    def unreadable(self, identity: bytes, why: str) -> list[Action]:
        """A connection that said hello as an agent sent what is no agent message: the job's own code (a job
        is untrusted) or a bug, and guessing what it meant could resize or stop the wrong way. Its job fails
        with the reason, as a user's error (no restart), and the agent is killed so that the job ends."""
        where = self._by_identity.get(identity)
        job = self.jobs.get(where[0]) if where else None
        if where is None or job is None:
            return []
        agent = where[1]
        if job.error is None or job.error.get("cause") == Cause.PEER_LOST:
            job.error = {"message": f"stopping the job: unreadable message from agent {agent.rank}: {why}",
                         "cause": Cause.USER.value, "rank": agent.rank}
        log.warning("job %s: unreadable message from agent %d: %s", job.job_id, agent.rank, why)
        return [Signal(agent.pid, "KILL")]

    def agent_message(self, identity: bytes, msg: p.Message, now: float) -> tuple[str | None, list[Action]]:
        """Apply an agent's message: an error text for the agent if it is not acceptable, and actions."""
        if isinstance(msg, p.AgentHello):
            job = self.jobs.get(msg.job_id)
            agent = job.agents.get(msg.rank) if job else None
            if agent is None:
                return f"no agent {msg.rank} of job {msg.job_id} runs on this node", []
            if msg.info.pid != agent.pid:
                return f"agent {msg.rank} of job {msg.job_id} is pid {agent.pid}, not {msg.info.pid}", []
            # Any process that can open the agent socket can name a job, a rank and a pid (/proc shows them);
            # only the agent holds the token it was started with.
            if not agent.token or not hmac.compare_digest(msg.token.encode(), agent.token.encode()):
                log.warning("job %s: a hello as agent %d without its token refused", msg.job_id, msg.rank)
                return f"not agent {msg.rank} of job {msg.job_id}: wrong token", []
            agent.identity = identity
            self._by_identity[identity] = (msg.job_id, agent)
            log.info("job %s: agent %d up (pid %d)%s", msg.job_id, msg.rank, agent.pid,
                     " as a warm joiner" if agent.standby else "")
            return None, []
        where = self._by_identity.get(identity)
        job = self.jobs.get(where[0]) if where else None
        agent = where[1] if where else None
        if agent is None or job is None:
            return "say agent_hello first", []
        if getattr(msg, "job_id", None) != job.job_id or getattr(msg, "rank", None) not in (agent.rank,
                                                                                          agent.former_rank):
            return f"this connection is agent {agent.rank} of job {job.job_id}", []
        if isinstance(msg, p.AgentStep):
            agent.step = msg.step
            agent.metrics = p.flat_metrics(msg.metrics)
            agent.step_times.append((now, msg.step))
            del agent.step_times[:-20]
            if msg.timing:
                _timed(agent, msg.timing)
            actions = self.resizes.stepped(job, agent)
            if msg.step in job.launch.hold_at and job.agents and agent is job.lead():
                # The agents stop after this step and wait for the scheduled resize: the scheduler starts it
                # once it hears of the step, and a heartbeat later would hold the job that much longer.
                actions.append(Report())
            return None, actions
        if isinstance(msg, p.AgentFailed):
            error = msg.error.as_dict(msg.job_id, msg.rank)
            if agent.pending:
                job.resize_error = job.resize_error or error
            elif job.error is None:
                job.error = error
        elif isinstance(msg, p.AgentResized):
            agent.timing_acc = {}   # steps of the old layout say nothing of the new one's
            return None, self.resizes.resized(job, agent, msg.info)
        elif isinstance(msg, p.AgentResizeRefused):
            return None, self.resizes.refused(job, agent, msg.info)
        elif isinstance(msg, p.AgentDone):
            agent.done = True
        else:
            return f"unexpected {msg.op!r} on the agent socket", []
        return None, []

    # --- views -----------------------------------------------------------------------------------

    def live(self) -> list[Agent]:
        """Agents whose exit was not reported yet, the job's own before the retired ones."""
        return [a for j in self.jobs.values() for a in j.everyone() if a.exitcode is None]

    def busy_devices(self) -> set[str]:
        return {a.device.device_id for a in self.live()}

    def reports(self, saved: Mapping[str, tuple[int, list[int]]]) -> list[p.JobReport]:
        """Every job's report; `saved`: by job, the newest resize snapshot kept here and its parts."""
        out = []
        for job in self.jobs.values():
            lead = job.lead() if job.agents else None
            rate = 0.0
            metrics: dict[str, Any] = {}
            if lead is not None:
                metrics = dict(lead.metrics)
                rate = metrics.pop("steps_per_s", None) or _rate(lead.step_times)
            epoch, parts = saved.get(job.job_id, (0, []))
            out.append(p.JobReport(
                job_id=job.job_id, state=job.state, ranks=sorted(job.agents), master_port=job.master_port,
                step=lead.step if lead else 0, steps_per_s=round(float(rate), 4), metrics=metrics,
                # Maps of scalars, as the scheduler decodes them: one job's odd record must never make the
                # whole heartbeat undecodable and cost the node its membership.
                ok=job.ok, error=_flat(job.error), resizes=list(job.resizes),
                resize_epoch=job.resize_epoch, resize_port=job.resize_port, resize_error=_flat(job.resize_error),
                snapshot_epoch=epoch, snapshot_parts=parts, restore_epoch=job.launch.restore_epoch,
                incarnation=job.launch.incarnation,
                agents=[p.AgentReport(rank=a.rank, device_id=a.device.device_id, pid=a.pid,
                                      alive=a.exitcode is None, connected=a.identity is not None,
                                      exitcode=a.exitcode, rss=a.rss, cpu=round(a.cpu, 1), standby=a.standby, warm=a.warm,
                                      epoch=a.epoch, stepped=a.stepped, left=a.left, completed=a.completed,
                                      timing=dict(a.timing))
                        for a in job.everyone()]))
        return self._fit(out)

    def _fit(self, reports: list[p.JobReport]) -> list[p.JobReport]:
        """The reports cut to fit one heartbeat: a node whose heartbeat is refused as too large is declared
        lost, with every job on it, so what jobs say (their metrics, their errors' text) must give way
        first, the largest first, never the node's membership."""
        sizes = {id(r): p.encoded_size(r) for r in reports}
        total = sum(sizes.values())
        for r in sorted(reports, key=lambda r: -sizes[id(r)]):
            if total <= HEARTBEAT_BUDGET:
                break
            before = sizes[id(r)]
            r.metrics = {}
            r.error, r.resize_error = _cut(r.error), _cut(r.resize_error)
            total -= before - p.encoded_size(r)
            if r.job_id not in self._cut_warned:
                self._cut_warned.add(r.job_id)
                log.warning("job %s: its report (%d bytes) would not fit the node's heartbeat; its metrics and "
                            "error text are left out of it", r.job_id, before)
        return reports

    # --- internals -------------------------------------------------------------------------------

    def _fence(self, job: NodeJob, now: float) -> list[Action]:
        """SIGKILL the job's agents its watchdog finds stuck; the first names the job's failure (cause
        "stuck", which the scheduler recovers from as from a killed agent)."""
        watched = {a.pid: a for a in job.agents.values()
                   if a.exitcode is None and not a.pending and a.pid not in job.fenced}
        job.watchdog.retain(watched)
        if job.killing is not None or not watched:
            return []
        out: list[Action] = []
        for fence in job.watchdog.verdict(now):
            agent = watched[fence.key]   # type: ignore[index]
            job.fenced.add(agent.pid)
            message = fence.cause(agent.rank, job.watchdog.describe())
            log.warning("job %s: %s", job.job_id, message)
            if job.error is None or job.error.get("cause") == Cause.PEER_LOST:
                job.error = {"cause": Cause.STUCK.value, "message": message, "rank": agent.rank,
                             "held_s": round(fence.held, 3)}
            out.append(Signal(agent.pid, "KILL"))
        return out

    def _escalate(self, job: NodeJob, now: float) -> list[Action]:
        out: list[Action] = []
        if job.term_at is not None and now >= job.term_at:
            job.term_at = float("inf")
            job.kill_at = now + TERM_GRACE_S
            # An agent that said done obeyed the stop and is tearing down (gloo, threads, atexit: seconds on
            # a loaded node); SIGTERM would turn its clean exit into a failure. It still gets SIGKILL below.
            out += [Signal(a.pid, "TERM") for a in job.everyone() if a.exitcode is None and not a.done]
        if job.kill_at is not None and now >= job.kill_at:
            job.kill_at = None
            out += [Signal(a.pid, "KILL") for a in job.everyone() if a.exitcode is None]
        return out

    def _drop(self, job: NodeJob) -> None:
        for a in job.everyone():
            self._by_identity.pop(a.identity or b"", None)
            if self._by_pid.get(a.pid, (None, None))[1] is a:
                del self._by_pid[a.pid]
        self.jobs.pop(job.job_id, None)


_SIGTERM, _SIGKILL = 15, 9   # POSIX numbers: an exit code -N is death by signal N (the core imports no OS module)


def _first_cause(job: NodeJob, error: dict[str, Any], code: int) -> bool:
    """Whether `error` names the failure better than the job's: an agent that lost its group was reaped
    before the agent whose death broke it (the order of reaping is not the order of dying). A signal this
    daemon sent while stopping the job is not a cause."""
    if job.error is None or job.error.get("cause") != Cause.PEER_LOST or error.get("cause") == Cause.PEER_LOST:
        return False
    sent_term = job.term_at == float("inf")
    sent_kill = sent_term and job.kill_at is None
    return not ((code == -_SIGTERM and sent_term) or (code == -_SIGKILL and sent_kill))


TIMING_STEPS = 3   # steps one published timing covers at least: single steps are too noisy to learn from


def _timed(agent: Agent, timing: dict[str, Any]) -> None:
    """Add an agent's step timing (throttled by the agent, often one step) to what it has not published yet;
    publish it, numbered so that the scheduler counts it once however many heartbeats repeat it, once it
    covers TIMING_STEPS steps."""
    try:
        t = clean_timing(timing)
    except ValueError as e:
        log.warning("agent %d: %s; ignored", agent.rank, e)
        return
    acc = agent.timing_acc if agent.timing_acc.get("hosted") == t["hosted"] else {}
    acc = merge_timing(acc, t)
    if acc["steps"] < TIMING_STEPS:
        agent.timing_acc = acc
        return
    agent.timing_acc = {}
    agent.timing_seq += 1
    agent.timing = {**acc, "seq": agent.timing_seq}


def _cut(record: dict[str, Any] | None) -> dict[str, Any] | None:
    """An error record with its strings shortened (a report cut to fit a heartbeat); the log keeps them whole."""
    if record is None:
        return None
    return {k: v[:CUT_TEXT_CHARS] if isinstance(v, str) else v for k, v in record.items()}


def _flat(record: dict[str, Any] | None) -> dict[str, Any] | None:
    return None if record is None else p.flat_scalars(record)


def _rate(times: list[tuple[float, int]]) -> float:
    if len(times) < 2 or times[-1][0] <= times[0][0]:
        return 0.0
    return (times[-1][1] - times[0][1]) / (times[-1][0] - times[0][0])
