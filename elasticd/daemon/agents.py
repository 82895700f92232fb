"""Spawning and watching this node's agent processes.

One agent process per (job, device), each in its own session so that stopping it reaches any child it
started. Liveness comes from the process table (`Popen.poll`, psutil for RSS and CPU), not from the
agent's own messages: a hung or SIGKILLed agent is still seen. Progress (step, loss) comes from the
agents' control messages.

Stopping escalates: a stop command on the control socket (the runtime stops at its next step
boundary), then SIGTERM to the agent's process group, then SIGKILL. When one local agent of a job
fails, its siblings are terminated at once: they would otherwise wait forever on a collective.

Live resize (elasticd.daemon.resizing) adds two kinds of agents to a job: joiners, started warm before
a grow and counted in only once they re-formed with the others, and agents that left in a shrink
(`LocalJob.retired`), which exit 0 on their own and free their device when gone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from elasticd import protocol as p
from elasticd.agent import module_command
from elasticd.agent.config import AgentConfig
from elasticd.daemon.resizing import NodeResizes
from elasticd.daemon.spares import SparePool
from elasticd.daemon.statedir import StateDir
from elasticd.ports import free_port

log = logging.getLogger(__name__)

STOP_GRACE_S = 5.0     # after a stop command, before SIGTERM
TERM_GRACE_S = 3.0     # after SIGTERM, before SIGKILL
SAMPLE_EVERY_S = 1.0   # psutil sampling period


# Agents must not outlive a daemon that is SIGKILLed: nothing would watch or stop them, and they would
# hold devices the restarted daemon hands out again. On Linux each agent is started through this
# prelude, which asks the kernel to SIGTERM it when the daemon dies, then execs the agent (same pid).
_DEATH_SIGNAL_PRELUDE = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG\n"
    "os.getppid() == int(sys.argv[1]) or os._exit(70)  # the daemon died before prctl\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def default_agent_command() -> list[str]:
    return module_command()


def with_death_signal(command: list[str]) -> list[str]:
    if not sys.platform.startswith("linux"):
        return command
    return [sys.executable, "-c", _DEATH_SIGNAL_PRELUDE, str(os.getpid()), *command]


def _agent_env(job_env: dict[str, str]) -> dict[str, str]:
    return {**os.environ, **job_env, "PYTHONUNBUFFERED": "1"}


@dataclass(eq=False)
class Agent:
    rank: int
    device: p.DeviceInfo
    popen: subprocess.Popen
    log_path: Path
    error_path: Path
    ps: psutil.Process | None = None
    identity: bytes | None = None       # control-socket identity once it said hello
    exitcode: int | None = None
    rss: int = 0
    cpu: float = 0.0
    step: int = 0
    metrics: dict[str, Any] = field(default_factory=dict)
    step_times: list[tuple[float, int]] = field(default_factory=list)
    # live resize
    standby: bool = False      # a joiner, warm, waiting for the hand-over
    joining: bool = False      # a joiner told to join, not yet re-formed with the others
    epoch: int = 0             # last resize epoch this agent finished
    stepped: int = 0           # last resize epoch after which it completed a step at the new size
    left: bool = False         # left the job in a shrink: exits 0, then its device is free
    dropped: bool = False      # a joiner sent away (resize called off, job ended first): exit code is no verdict
    kill_at: float | None = None   # SIGKILL deadline of a dropped joiner

    @property
    def pending(self) -> bool:
        """A joiner that is not part of the job's group yet."""
        return self.standby or self.joining


@dataclass(eq=False)
class LocalJob:
    job_id: str
    launch: p.LaunchJob
    master_port: int
    agents: dict[int, Agent] = field(default_factory=dict)   # by physical rank: the job's agents and joiners
    retired: list[Agent] = field(default_factory=list)      # left in a shrink or dropped joiners, until gone
    error: dict[str, Any] | None = None
    resizes: list[dict[str, Any]] = field(default_factory=list)
    killing: str | None = None          # reason, once a stop/kill started
    term_at: float | None = None        # when to send SIGTERM
    kill_at: float | None = None        # when to send SIGKILL
    resize_epoch: int = 0               # the resize being prepared or carried out here
    resize_port: int = 0                # its rendezvous port (this node hosts rank 0)
    resize_error: dict[str, Any] | None = None   # a joiner died before the hand-over
    restored: bool = False              # launched from a snapshot (restore_epoch) and a step completed since

    def everyone(self) -> list[Agent]:
        return [*self.agents.values(), *self.retired]

    @property
    def state(self) -> str:
        if all(a.exitcode is not None for a in self.everyone()):
            return "ended"
        if all(a.identity is not None or a.exitcode is not None for a in self.agents.values() if not a.standby):
            return "running"
        return "launching"

    @property
    def ok(self) -> bool:
        return self.error is None and self.killing is None and all(a.exitcode == 0 for a in self.agents.values())

    def lead(self) -> Agent:
        """The agent whose progress stands for the job here: the lowest physical rank on this node."""
        return self.agents[min(self.agents)]

    def retire(self, agent: Agent) -> None:
        if self.agents.get(agent.rank) is agent:
            del self.agents[agent.rank]
            self.retired.append(agent)


class Supervisor(NodeResizes):
    """This node's agents, by job. Not thread-safe: the daemon's loop owns it."""

    def __init__(self, sd: StateDir, devices: list[p.DeviceInfo], control_endpoint: str, host: str,
                 agent_command: list[str] | None = None, spares: int | None = 0) -> None:
        """`spares`: at most this many warm spare agents (one per idle device and at least one); None: no cap."""
        self.sd = sd
        self.devices = {d.device_id: d for d in devices}
        self.control_endpoint = control_endpoint
        self.host = host
        self.agent_command = agent_command or default_agent_command()
        self.jobs: dict[str, LocalJob] = {}
        self._by_identity: dict[bytes, tuple[str, Agent]] = {}
        self._next_sample = 0.0
        self.changed = False   # something the scheduler should hear about now (not at the next heartbeat)
        # A spare runs `python -m agent`'s code in-process: another agent command (a test's fake) cannot use one.
        own = self.agent_command == default_agent_command()
        limit = len(self.devices) if spares is None else spares
        self.spares = SparePool(limit if own else 0, _agent_env({}), sd.root, sd.root / "spares.log",
                                wrap=with_death_signal)
        if limit and not own:
            log.info("no spare agents: the agent command is not `python -m agent`")
        # Resize snapshots of a previous life of this daemon: its agents died with it (PR_SET_PDEATHSIG),
        # so no job here can fall back to them, and tmpfs would hold them until the host reboots.
        shutil.rmtree(sd.snapshot_root, ignore_errors=True)
        sd.snapshot_root.mkdir(mode=0o700, parents=True, exist_ok=True)   # /dev/shm is world-readable

    # --- commands from the scheduler -------------------------------------------------------------

    def launch(self, msg: p.LaunchJob, now: float) -> bool:
        """Spawn this node's agents of a job (idempotent). False if the launch was refused or failed."""
        old = self.jobs.get(msg.job_id)
        if old is not None and old.state != "ended":
            log.info("job %s: launch repeated while its agents run; ignored", msg.job_id)
            return True
        if old is not None:
            self._drop(old)
        unknown = [pl.device_id for pl in msg.placements if pl.device_id not in self.devices]
        port = msg.master_port or free_port(self.host)
        job = LocalJob(msg.job_id, msg, port)
        self.jobs[msg.job_id] = job
        if unknown or not msg.placements:
            job.error = {"message": f"node has no device(s) {unknown}" if unknown else "launch without ranks"}
            log.error("job %s: %s", msg.job_id, job.error["message"])
            return False
        for pl in msg.placements:
            try:
                agent = self._start_agent(job, pl.rank, msg.world, pl.device_id, f"rank{pl.rank}.json",
                                          master_addr=msg.master_addr, master_port=port)
            except (OSError, ValueError) as e:
                job.error = {"message": f"cannot start agent {pl.rank}: {e}"}
                log.error("job %s: %s", msg.job_id, job.error["message"])
                self.kill(msg.job_id, "a sibling agent could not start", now, graceful=False)
                return False
            job.agents[pl.rank] = agent
        log.info("job %s: launched ranks %s (world %d, rendezvous %s:%d)", msg.job_id,
                 [pl.rank for pl in msg.placements], msg.world, msg.master_addr, port)
        return True

    def _start_agent(self, job: LocalJob, rank: int, world: int, device_id: str, error_name: str, *,
                     master_addr: str = "", master_port: int = 0, standby: bool = False) -> Agent:
        """Spawn one agent process of `job`.

        Raises:
            OSError, ValueError: it could not be started.
        """
        msg = job.launch
        dev = self.devices[device_id]
        log_dir, err_dir = self.sd.log_dir(msg.job_id), self.sd.error_dir(msg.job_id)
        log_dir.mkdir(parents=True, exist_ok=True)
        err_dir.mkdir(parents=True, exist_ok=True)
        err_path = err_dir / error_name
        err_path.unlink(missing_ok=True)
        cfg = AgentConfig(script=msg.script, func=msg.func, workers=msg.workers, rank=rank, world=world,
                          device_type=dev.type, device_index=dev.index, master_addr=master_addr or "127.0.0.1",
                          master_port=master_port, job_id=msg.job_id, control=self.control_endpoint,
                          error_file=str(err_path), standby=standby,
                          snapshot_dir=str(self.sd.snapshot_dir(msg.job_id)),
                          restore_epoch=0 if standby else msg.restore_epoch)
        log_path = log_dir / f"rank{rank}.log"
        popen = self._spawn(cfg, msg, log_path)
        agent = Agent(rank, dev, popen, log_path, err_path, standby=standby)
        try:
            agent.ps = psutil.Process(popen.pid)
            agent.ps.cpu_percent(None)
        except psutil.Error:
            pass
        return agent

    def _spawn(self, cfg: AgentConfig, msg: p.LaunchJob, log_path: Path) -> subprocess.Popen:
        env = _agent_env({**msg.env, "ELASTICD_JOB_ID": msg.job_id})
        cwd = msg.cwd if msg.cwd and os.path.isdir(msg.cwd) else str(self.sd.root)
        with open(log_path, "ab") as out:
            out.write(f"=== elasticd: job {msg.job_id} agent {cfg.rank}/{cfg.world} on {cfg.device_type}:"
                      f"{cfg.device_index} started {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n".encode())
            out.flush()
            spare = self.spares.take(cfg.to_argv(), env, cwd, log_path, f"job {msg.job_id} agent {cfg.rank}")
            if spare is not None:
                return spare
            return subprocess.Popen(with_death_signal([*self.agent_command, *cfg.to_argv()]),
                                    stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True)

    def kill(self, job_id: str, reason: str, now: float, graceful: bool = True) -> list[tuple[bytes, p.Message]]:
        """Start stopping a job's agents; returns the stop commands to send on the control socket."""
        job = self.jobs.get(job_id)
        if job is None or job.state == "ended":
            return []
        if job.killing is None:
            job.killing = reason
            log.info("job %s: stopping agents (%s)", job_id, reason)
        if not graceful:
            if job.term_at != float("inf"):  # not already past SIGTERM
                job.term_at = now
                self._escalate(job, now)
            return []
        if job.term_at is not None:
            return []
        job.term_at = now + STOP_GRACE_S
        return [(a.identity, p.AgentStop()) for a in job.everyone()
                if a.identity is not None and a.exitcode is None]

    def forget(self, job_ids: list[str]) -> None:
        for job_id in job_ids:
            job = self.jobs.get(job_id)
            if job is not None and job.state == "ended":
                self._drop(job)
                # Over for the scheduler: no relaunch will restore from what its agents saved here.
                shutil.rmtree(self.sd.snapshot_dir(job_id), ignore_errors=True)

    # --- messages from agents --------------------------------------------------------------------

    def agent_message(self, identity: bytes, msg: p.Message, now: float) -> str | None:
        """Apply an agent's message; returns an error text for the agent if it is not acceptable."""
        if isinstance(msg, p.AgentHello):
            job = self.jobs.get(msg.job_id)
            agent = job.agents.get(msg.rank) if job else None
            if agent is None:
                return f"no agent {msg.rank} of job {msg.job_id} runs on this node"
            pid = msg.info.get("pid")
            if isinstance(pid, int) and pid != agent.popen.pid:
                return f"agent {msg.rank} of job {msg.job_id} is pid {agent.popen.pid}, not {pid}"
            agent.identity = identity
            self._by_identity[identity] = (msg.job_id, agent)
            log.info("job %s: agent %d up (pid %d)%s", msg.job_id, msg.rank, agent.popen.pid,
                     " as a warm joiner" if agent.standby else "")
            return None
        where = self._by_identity.get(identity)
        job = self.jobs.get(where[0]) if where else None
        agent = where[1] if where else None
        if agent is None or job is None:
            return "say agent_hello first"
        if getattr(msg, "job_id", None) != job.job_id or getattr(msg, "rank", None) != agent.rank:
            return f"this connection is agent {agent.rank} of job {job.job_id}"
        if isinstance(msg, p.AgentStep):
            agent.step = msg.step
            agent.metrics = p.flat_scalars(msg.metrics)
            agent.step_times.append((now, msg.step))
            del agent.step_times[:-20]
            if agent.epoch > agent.stepped:   # the first step at the new size ends a resize: tell at once
                agent.stepped = agent.epoch
                self.changed = True
                # A step at the new size ran a collective with every agent: nothing falls back to the
                # snapshot of this resize any more (nor of an older one).
                self.drop_snapshots(job, agent.epoch)
            elif job.launch.restore_epoch and not job.restored:
                job.restored = True   # the same, for the snapshot this launch started from
                self.drop_snapshots(job, job.launch.restore_epoch)
        elif isinstance(msg, p.AgentFailed):
            if agent.pending:
                job.resize_error = job.resize_error or p.flat_scalars(msg.error)
            elif job.error is None:
                job.error = p.flat_scalars(msg.error)
        elif isinstance(msg, p.AgentResized):
            self.resized(job, agent, p.flat_scalars(msg.info))
        elif not isinstance(msg, p.AgentDone):
            return f"unexpected {msg.op!r} on the agent socket"
        return None

    # --- watching --------------------------------------------------------------------------------

    def poll(self, now: float) -> bool:
        """Reap exited agents, escalate stops, sample usage. True when a job's state changed."""
        changed = False
        busy = {a.device.device_id for j in self.jobs.values() for a in j.everyone() if a.exitcode is None}
        self.spares.want(len(self.devices) - len(busy))
        self.spares.replenish()
        sample = now >= self._next_sample
        if sample:
            self._next_sample = now + SAMPLE_EVERY_S
        for job in list(self.jobs.values()):
            before = job.state
            for agent in list(job.agents.values()):
                if agent.exitcode is not None:
                    continue
                code = agent.popen.poll()
                if code is not None:
                    self._exited(job, agent, code, now)
                elif sample and agent.ps is not None:
                    try:
                        with agent.ps.oneshot():
                            agent.rss = agent.ps.memory_info().rss
                            agent.cpu = agent.ps.cpu_percent(None)
                    except psutil.Error:
                        pass
            for agent in list(job.retired):
                if agent.exitcode is None:
                    code = agent.popen.poll()
                    if code is not None:
                        self._exited(job, agent, code, now)
                    elif agent.kill_at is not None and now >= agent.kill_at:
                        agent.kill_at = None
                        _signal_group(agent.popen.pid, signal.SIGKILL)
            changed |= self.after_exits(job, now)
            self._escalate(job, now)
            changed |= job.state != before
        changed |= self.changed
        self.changed = False
        return changed

    def _exited(self, job: LocalJob, agent: Agent, code: int, now: float) -> None:
        agent.exitcode = code
        self._by_identity.pop(agent.identity or b"", None)
        level = logging.INFO if code == 0 or agent.dropped else logging.WARNING
        log.log(level, "job %s: agent %d (pid %d) exited with code %d%s", job.job_id, agent.rank, agent.popen.pid,
                code, " (left in a resize)" if agent.left else " (joiner sent away)" if agent.dropped else "")
        if agent.dropped or agent.left:
            return
        if agent.standby:
            self.joiner_died(job, agent, code)
            return
        if code != 0 and job.killing is None:
            if job.error is None:
                job.error = self._error_of(agent, code)
            job.error.setdefault("rank", agent.rank)
            self.kill(job.job_id, f"agent {agent.rank} failed", now, graceful=False)

    def _error_of(self, agent: Agent, code: int) -> dict[str, Any]:
        try:
            err = p.flat_scalars(json.loads(agent.error_path.read_text()))
            if err:
                return err
        except (OSError, ValueError):
            pass
        return {"message": f"agent {agent.rank} exited with code {code} and left no error report "
                           "(killed? out of memory?)", "log_tail": _tail(agent.log_path)}

    def _escalate(self, job: LocalJob, now: float) -> None:
        if job.term_at is not None and now >= job.term_at:
            job.term_at = float("inf")
            job.kill_at = now + TERM_GRACE_S
            _signal_all(job, signal.SIGTERM)
        if job.kill_at is not None and now >= job.kill_at:
            job.kill_at = None
            _signal_all(job, signal.SIGKILL)

    def reports(self) -> list[p.JobReport]:
        out = []
        for job in self.jobs.values():
            lead = job.lead() if job.agents else None
            rate = 0.0
            metrics: dict[str, Any] = {}
            if lead is not None:
                metrics = dict(lead.metrics)
                rate = metrics.pop("steps_per_s", None) or _rate(lead.step_times)
            saved = self.snapshot_parts(job)
            out.append(p.JobReport(
                job_id=job.job_id, state=job.state, ranks=sorted(job.agents), master_port=job.master_port,
                step=lead.step if lead else 0, steps_per_s=round(float(rate), 4), metrics=metrics,
                ok=job.ok, error=job.error, resizes=list(job.resizes), resize_epoch=job.resize_epoch,
                resize_port=job.resize_port, resize_error=job.resize_error,
                snapshot_epoch=saved[0], snapshot_parts=saved[1], restore_epoch=job.launch.restore_epoch,
                agents=[p.AgentReport(rank=a.rank, device_id=a.device.device_id, pid=a.popen.pid,
                                      alive=a.exitcode is None, connected=a.identity is not None,
                                      exitcode=a.exitcode, rss=a.rss, cpu=round(a.cpu, 1), standby=a.standby,
                                      epoch=a.epoch, stepped=a.stepped, left=a.left)
                        for a in job.everyone()]))
        return out

    def live_agents(self) -> int:
        return sum(a.exitcode is None for j in self.jobs.values() for a in j.everyone())

    def shutdown(self, timeout_s: float = TERM_GRACE_S) -> None:
        """Stop every agent now (SIGTERM, then SIGKILL after `timeout_s`) and reap them."""
        self.spares.shutdown(timeout_s)
        for job in self.jobs.values():
            _signal_all(job, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for job in self.jobs.values():
            for a in job.everyone():
                try:
                    a.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    _signal_group(a.popen.pid, signal.SIGKILL)
                    a.popen.wait()
        shutil.rmtree(self.sd.snapshot_root, ignore_errors=True)

    def _drop(self, job: LocalJob) -> None:
        for a in job.everyone():
            self._by_identity.pop(a.identity or b"", None)
        self.jobs.pop(job.job_id, None)


def _signal_all(job: LocalJob, sig: int) -> None:
    for a in job.everyone():
        if a.exitcode is None:
            _signal_group(a.popen.pid, sig)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _rate(times: list[tuple[float, int]]) -> float:
    if len(times) < 2 or times[-1][0] <= times[0][0]:
        return 0.0
    return (times[-1][1] - times[0][1]) / (times[-1][0] - times[0][0])


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
