"""Spawning and watching this node's agent processes: the I/O shell of elasticd.daemon.supervision.

The pure core decides (which agent to start, whom to signal, what to tell an agent or the scheduler);
`AgentProcesses` feeds it what happened and carries out the actions it returns, as the scheduler's server
carries out its state machine's. Here live the processes (`Popen`, psutil for RSS and CPU), signals,
the warm spare pool (elasticd.daemon.spares) and the files under the state dir: logs, error reports,
resize snapshots.

One agent process per (job, device), each in its own session so that a signal to its process group
reaches any child it started. Agents are started through a prelude that makes the kernel stop them if
the daemon dies (a forked spare's through its fork server, which is started so, elasticd/daemon/spares.py).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from elasticd import forked
from elasticd import protocol as p
from elasticd.core import parts as saved_parts
from elasticd.core.agent_config import AgentConfig
from elasticd.core.commands import module_command
from elasticd.core.env_names import AGENT_TOKEN_VAR, QUIET_SPARE_VAR
from elasticd.core.failures import Cause, how_it_ended
from elasticd.core.files import read_regular
from elasticd.core.watchdog import WATCH_EVERY_S, Beat, beat_path, is_stopped, read_beat
from elasticd.daemon import job_user
from elasticd.daemon.actions import Action, DropSnapshots, Report, SendToAgent, Signal, Spawn
from elasticd.daemon.job_user import JobUser
from elasticd.daemon.spares import SparePool, signal_group, signal_pid_group
from elasticd.daemon.supervision import TERM_GRACE_S, Supervision
from elasticd.forked import ForkedProcess
from elasticd.ports import free_port
from elasticd.statedir import StateDir, UnsafeStateDir, unsafe_dir

log = logging.getLogger(__name__)

SAMPLE_EVERY_S = 1.0   # psutil sampling period
_SIGNALS = {"TERM": signal.SIGTERM, "KILL": signal.SIGKILL}


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


def agent_env(job_env: dict[str, str]) -> dict[str, str]:
    """The environment an agent of this daemon starts with: the daemon's own, the job's, unbuffered output.
    A shared fork server its spares come from must have the same interpreter-start variables
    (elasticd/startup_env.py)."""
    return {**os.environ, **job_env, "PYTHONUNBUFFERED": "1"}


@dataclass(eq=False)
class _Process:
    """What the shell holds of one agent until it is reaped."""

    popen: subprocess.Popen | ForkedProcess
    ps: psutil.Process | None
    log_path: Path
    error_path: Path
    uid: int          # the user it runs as, who owns the files it leaves in its job's directory


class AgentProcesses:
    """This node's agents, by job. Not thread-safe: the daemon's loop owns it."""

    def __init__(self, sd: StateDir, devices: list[p.DeviceInfo], control_endpoint: str, host: str,
                 agent_command: list[str] | None = None, spares: int | None = 0, pin_cpus: bool = False,
                 inherit_output: bool = False, pin_by_rank: bool = False,
                 log_keep_s: float | None = None, jobs_as: JobUser | None = None) -> None:
        """`spares`: at most this many warm spare agents (one per idle device and at least one); None: no cap.
        `pin_cpus`: each CPU device's agent is bound to its own block of the machine's cores. `log_keep_s`:
        a job's logs untouched this long go (the scheduler's --job-retention; None: kept). `jobs_as`: the
        user jobs run as unless theirs names another (default: this process's). The agents' area must
        be open (`open_agent_root`)."""
        self.sd = sd
        self.jobs_as = jobs_as or job_user.own()
        self.core = Supervision(devices)
        self.control_endpoint = control_endpoint
        self.host = host
        cpus = sum(d.type == "cpu" for d in devices)
        # By rank (0): the one node of an `elasticd run`, whose job has every device, re-cut at each resize.
        self._cpu_slots = 0 if pin_by_rank else cpus if pin_cpus and cpus else -1
        self._inherit_output = inherit_output   # agents write to this process's stdout and stderr, not logs
        self.agent_command = agent_command or default_agent_command()
        self._procs: dict[int, _Process] = {}   # by pid, until reaped
        self._next_sample = 0.0
        self._next_watch = 0.0
        self._log_keep_s = log_keep_s
        self._next_log_sweep = 0.0
        self.changed = False   # something the scheduler should hear about now (not at the next heartbeat)
        # A spare runs `python -m agent`'s code in-process: another agent command (a test's fake) cannot use one.
        own = self.agent_command == default_agent_command()
        limit = len(devices) if spares is None else spares
        quiet = {QUIET_SPARE_VAR: "1"} if inherit_output else {}
        self.spares = SparePool(limit if own else 0, agent_env(quiet), sd.root,
                                None if inherit_output else sd.root / "spares.log",
                                wrap=with_death_signal, fork=forked.supported())
        if limit and not own:
            log.info("no spare agents: the agent command is not `python -m agent`")

    # --- commands from the scheduler: the agent commands to send on the control socket come back ---

    def launch(self, msg: p.LaunchJob, now: float) -> bool:
        """Spawn this node's agents of a job (idempotent). False if the launch was refused or failed."""
        old = self.core.jobs.get(msg.job_id)
        repeated = old is not None and old.state != "ended"
        port = 0 if msg.master_port or repeated else free_port(self.host)
        self._execute_here(self.core.launch(msg, port), now)
        return repeated or self.core.jobs[msg.job_id].error is None

    def kill(self, job_id: str, reason: str, now: float, graceful: bool = True) -> list[tuple[bytes, p.Message]]:
        """Start stopping a job's agents; returns the stop commands to send on the control socket."""
        return self._execute(self.core.kill(job_id, reason, now, graceful), now)

    def forget(self, job_ids: list[str]) -> None:
        self._execute_here(self.core.forget(job_ids), time.time())

    def prepare(self, msg: p.PrepareResize, now: float) -> None:
        self._execute_here(self.core.prepare(msg, free_port(self.host) if msg.pick_port else 0), now)

    def go(self, msg: p.ResizeJob) -> list[tuple[bytes, p.Message]]:
        """The commands for this node's agents: `resize` for the running ones, `join` for the joiners."""
        return self._execute(self.core.go(msg), time.time())

    def abort(self, msg: p.AbortResize, now: float) -> None:
        self._execute_here(self.core.abort(msg, now), now)

    # --- messages from agents --------------------------------------------------------------------

    def unreadable(self, identity: bytes, why: str, now: float) -> None:
        self._execute_here(self.core.unreadable(identity, why), now)

    def agent_message(self, identity: bytes, msg: p.Message, now: float) -> str | None:
        """Apply an agent's message; returns an error text for the agent if it is not acceptable."""
        err, actions = self.core.agent_message(identity, msg, now)
        self._execute_here(actions, now)
        return err

    # --- watching --------------------------------------------------------------------------------

    def poll(self, now: float) -> bool:
        """Reap exited agents, escalate stops, sample usage, drop old logs. True when a job's state changed."""
        if now >= self._next_log_sweep:
            self._next_log_sweep = now + LOG_SWEEP_EVERY_S
            live = {job_id for job_id, job in self.core.jobs.items() if job.state != "ended"}
            if self._log_keep_s is not None:
                sweep_logs(self.sd, now, self._log_keep_s, live)
            sweep_span_snapshots(self.sd, now, {self.sd.span_snapshot_dir(job.launch.snapshot_key).name
                                                for job in self.core.jobs.values() if job.launch.snapshot_key})
        self.spares.want(len(self.core.devices) - len(self.core.busy_devices()))
        self.spares.replenish()
        sample = now >= self._next_sample
        if sample:
            self._next_sample = now + SAMPLE_EVERY_S
        watch = now >= self._next_watch   # the watchdog reads as often as `elasticd run`'s, usage less often
        if watch:
            self._next_watch = now + WATCH_EVERY_S
        for agent in self.core.live():
            proc = self._procs.get(agent.pid)
            if proc is None:
                continue
            code = proc.popen.poll()
            if code is not None:
                self.core.watched(agent.pid, now, False, _beat(proc, now))   # its last word on the steps it completed
                del self._procs[agent.pid]
                self._execute_here(self.core.exited(agent.pid, code, _error_of(proc, agent.rank, code), now), now)
            elif (sample or watch) and proc.ps is not None:
                try:
                    with proc.ps.oneshot():
                        if sample:
                            self.core.sampled(agent.pid, proc.ps.memory_info().rss, proc.ps.cpu_percent(None))
                        stopped = is_stopped(proc.ps.status())
                    self.core.watched(agent.pid, now, stopped, _beat(proc, now))
                except psutil.Error:
                    pass
        self._execute_here(self.core.tick(now, watch), now)
        changed, self.changed = self.changed, False
        return changed

    def reports(self) -> list[p.JobReport]:
        return self.core.reports({job_id: self.snapshot_parts(job_id) for job_id in self.core.jobs})

    def live_agents(self) -> int:
        return len(self.core.live())

    def shutdown(self, timeout_s: float = TERM_GRACE_S) -> None:
        """Stop every agent now (SIGTERM, then SIGKILL after `timeout_s`) and reap them."""
        self.spares.shutdown(timeout_s)
        for agent in self.core.live():
            self._signal(agent.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for pid, proc in self._procs.items():
            try:
                proc.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(pid, signal.SIGKILL)
                proc.popen.wait()
        self.spares.close()
        for entry in self.sd.agent_root.iterdir() if self.sd.agent_root.is_dir() else ():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)

    def _signal(self, pid: int, sig: int) -> None:
        proc = self._procs.get(pid)
        if proc is None:
            signal_pid_group(pid, sig)
        else:
            signal_group(proc.popen, sig)

    # --- the snapshots kept for falling back (agent/resize/fallback.py) --------------------------

    def snapshot_parts(self, job_id: str) -> tuple[int, list[int]]:
        """The newest resize snapshot the job's agents saved here, and its parts (for the scheduler)."""
        root = self.sd.snapshot_dir(job_id)
        epochs = saved_parts.epochs(root)
        if not epochs:
            return 0, []
        return epochs[-1], saved_parts.parts(root, epochs[-1])

    def _drop_snapshots(self, job_id: str, upto: int | None, under_key: str = "") -> None:
        root = self.sd.span_snapshot_dir(under_key) if under_key and upto is not None else self.sd.snapshot_dir(job_id)
        if upto is None and root == self.sd.job_dir(job_id):
            shutil.rmtree(root, ignore_errors=True)
            return
        if upto is None:   # a directory of the user's (`elasticd run --snapshot-dir`): only what the agents wrote
            for d in saved_parts.written(root):
                shutil.rmtree(d, ignore_errors=True)
            return
        for epoch in saved_parts.epochs(root):
            if epoch <= upto:
                shutil.rmtree(saved_parts.epoch_dir(root, epoch), ignore_errors=True)
                log.info("job %s: snapshot of resize %d dropped (a step completed after it)", job_id, epoch)

    # --- carrying out the core's actions ---------------------------------------------------------

    def _execute(self, actions: list[Action], now: float) -> list[tuple[bytes, p.Message]]:
        """Carry out `actions` in order; the agent commands among them are returned for the caller's socket."""
        sends: list[tuple[bytes, p.Message]] = []
        given_up: set[str] = set()   # jobs whose spawn failed in this batch
        queue = list(actions)
        while queue:
            a = queue.pop(0)
            if isinstance(a, Spawn):
                if a.job_id in given_up:
                    continue
                try:
                    self.core.started(a, *self._start_agent(a))
                except (OSError, ValueError) as e:
                    given_up.add(a.job_id)
                    queue += self.core.spawn_failed(a, str(e), now)
            elif isinstance(a, Signal):
                self._signal(a.pid, _SIGNALS[a.sig])
            elif isinstance(a, SendToAgent):
                sends.append((a.identity, a.msg))
            elif isinstance(a, Report):
                self.changed = True
            elif isinstance(a, DropSnapshots):
                self._drop_snapshots(a.job_id, a.upto, a.under_key)
                if a.span_key:
                    shutil.rmtree(self.sd.span_snapshot_dir(a.span_key), ignore_errors=True)
        return sends

    def _execute_here(self, actions: list[Action], now: float) -> None:
        """`_execute` where no caller takes agent commands: the core sends none there, and one that it
        did would be a bug to see, not a command to lose quietly."""
        for identity, msg in self._execute(actions, now):
            log.error("internal: %r for agent %r dropped (nobody sends it)", msg.op, identity)

    def _start_agent(self, spawn: Spawn) -> tuple[int, str]:
        """Spawn one agent process; its pid and the token it proves itself with on the agent socket.

        Raises:
            OSError, ValueError: it could not be started.
        """
        msg = spawn.launch
        dev = self.core.devices[spawn.device_id]
        user = job_user.for_job(msg.run_as, self.jobs_as)
        if user.switched and msg.cwd and os.path.isdir(msg.cwd):
            job_user.check_cwd(msg.cwd, user)
        log_dir, job_dir = self.sd.log_dir(msg.job_id), self.sd.job_dir(msg.job_id)
        log_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        job_user.own_dir(job_dir, user)
        snapshots = self.sd.span_snapshot_dir(msg.snapshot_key) if msg.snapshot_key else self.sd.snapshot_dir(msg.job_id)
        if msg.snapshot_key:
            job_user.own_dir(snapshots, user)
        err_path = job_dir / spawn.error_name
        err_path.unlink(missing_ok=True)
        Path(beat_path(str(err_path))).unlink(missing_ok=True)   # an earlier agent's of this rank: not this one's beat
        cfg = AgentConfig(script=msg.script, func=msg.func, workers=msg.workers, rank=spawn.rank, world=spawn.world,
                          device_type=dev.type, device_index=dev.index,
                          cpu_slots=self._cpu_slots if dev.type == "cpu" else -1,
                          master_addr=spawn.master_addr or "127.0.0.1", master_port=spawn.master_port,
                          job_id=msg.job_id, control=self.control_endpoint, error_file=str(err_path),
                          standby=spawn.standby, snapshot_dir=str(snapshots),
                          restore_epoch=spawn.restore_epoch, restore_latest=spawn.restore_latest,
                          snapshot_every=msg.snapshot_every, blocks=list(spawn.blocks), hold_at=tuple(spawn.hold_at),
                          threads=msg.threads, device_memory=msg.device_memory)
        log_path = log_dir / f"rank{spawn.rank}.log"
        token = secrets.token_hex(16)
        popen = self._spawn(cfg, msg, log_path, token, user, str(job_dir))
        ps: psutil.Process | None = None
        try:
            ps = psutil.Process(popen.pid)
            ps.cpu_percent(None)
        except psutil.Error:
            pass
        self._procs[popen.pid] = _Process(popen, ps, log_path, err_path, user.uid)
        return popen.pid, token

    def _spawn(self, cfg: AgentConfig, msg: p.LaunchJob, log_path: Path, token: str, user: JobUser, job_dir: str
               ) -> subprocess.Popen | ForkedProcess:
        env = agent_env({**msg.env, "ELASTICD_JOB_ID": msg.job_id, AGENT_TOKEN_VAR: token})
        if user.switched:
            env.update(user.env())
        cwd = msg.cwd if msg.cwd and os.path.isdir(msg.cwd) else job_dir
        who = {"user": user.uid, "group": user.gid, "extra_groups": list(user.groups)} if user.switched else {}
        what = f"job {msg.job_id} agent {cfg.rank}"
        if self._inherit_output:
            spare = self.spares.take(cfg.to_argv(), env, cwd, None, what, user if user.switched else None)
            return spare or subprocess.Popen(with_death_signal([*self.agent_command, *cfg.to_argv()]),
                                             stdin=subprocess.DEVNULL, cwd=cwd, env=env, start_new_session=True, **who)
        with open(log_path, "ab") as out:
            out.write(f"=== elasticd: job {msg.job_id} agent {cfg.rank}/{cfg.world} on {cfg.device_type}:"
                      f"{cfg.device_index} started {time.strftime('%Y-%m-%d %H:%M:%S')} ===\n".encode())
            out.flush()
            spare = self.spares.take(cfg.to_argv(), env, cwd, log_path, what, user if user.switched else None)
            if spare is not None:
                return spare
            return subprocess.Popen(with_death_signal([*self.agent_command, *cfg.to_argv()]),
                                    stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, cwd=cwd, env=env, start_new_session=True, **who)


# A crashed daemon's periodic snapshots are kept for the scheduler to restart their jobs from; a job that
# is not restarted here within this long is not coming back, and tmpfs would hold its files until a reboot.
SNAPSHOT_KEEP_S = 24 * 3600


LOG_SWEEP_EVERY_S = 3600.0
# The periodic snapshots a portion of a job spanning islands left when it ended unfinished: a restart of the
# job comes within seconds of the failure, so an hour unused means none will.
SPAN_SNAPSHOT_KEEP_S = 3600.0
MAX_ERROR_REPORT = 1 << 20   # bytes of an agent's error report read (a traceback of a deep recursion fits)


def sweep_span_snapshots(sd: StateDir, now: float, live: set[str], keep_s: float = SPAN_SNAPSHOT_KEEP_S) -> list[str]:
    """Delete the snapshot folders of portions of jobs spanning islands that no job here uses and that
    nothing has written to for `keep_s`. Returns their names."""
    try:
        folders = [f for f in sd.agent_root.iterdir() if f.name.startswith("span-")]
    except OSError:
        return []
    gone = _drop_stale(folders, now, keep_s, live, deep=True)
    if gone:
        log.info("dropped the snapshots of %d job(s) spanning islands, unused for %.0f s: %s", len(gone), keep_s,
                 ", ".join(gone[:10]))
    return gone


def sweep_logs(sd: StateDir, now: float, keep_s: float, live: set[str]) -> list[str]:
    """Delete the log folders of jobs not running here whose newest file is older than `keep_s`:
    by then the scheduler has purged the job, and its output is nobody's to read. Returns their names."""
    kind = sd.root / "logs"
    try:
        folders = list(kind.iterdir())
    except OSError:
        return []
    gone = [f"{kind.name}/{name}" for name in _drop_stale(folders, now, keep_s, live)]
    if gone:
        log.info("dropped the logs of %d job(s) ended more than %.0f s ago: %s", len(gone), keep_s,
                 ", ".join(gone[:10]))
    return gone


def _drop_stale(folders: list[Path], now: float, keep_s: float, live: set[str], deep: bool = False) -> list[str]:
    """Delete the folders not named in `live` whose newest entry (any depth if `deep`, else the top level)
    is older than `keep_s`; returns their names."""
    gone = []
    for folder in folders:
        if folder.name in live or folder.is_symlink() or not folder.is_dir():
            continue
        try:
            inside = folder.rglob("*") if deep else folder.iterdir()
            newest = max([folder.stat().st_mtime, *(f.stat().st_mtime for f in inside)])
        except OSError:
            continue
        if now - newest > keep_s:
            shutil.rmtree(folder, ignore_errors=True)
            gone.append(folder.name)
    return gone


def open_agent_root(sd: StateDir, shared: bool, now: float) -> Path:
    """Make the agents' area ready before the agent socket is bound there: a directory of this user's
    (0711 when `shared`: agents running as other users may pass through to their own job's directory and
    the socket, nothing else), cleared of what a previous life of this daemon left.

    Its agents died with it (PR_SET_PDEATHSIG), so no resize can fall back to a resize snapshot (`e<E>/`):
    those go. Periodic snapshots (`s<S>/`) stay: the scheduler restarts the job, here or elsewhere, from
    the newest complete one (elasticd.scheduler.recovery). Job directories untouched for SNAPSHOT_KEEP_S go
    whole: tmpfs would hold their files until a reboot.

    Raises:
        UnsafeStateDir: the path exists and is not a directory of this user's (on a world-writable tmpfs
            anyone could have made it first, to read the snapshots written there or plant links).
    """
    root = sd.agent_root
    try:
        root.mkdir(mode=0o700)
    except FileExistsError:
        pass
    why = unsafe_dir(os.lstat(root), own=True)
    if why:
        raise UnsafeStateDir(f"refusing to use {root} for the agents' files: it is {why}; someone else made it. "
                             "Remove it, or use another --state-dir")
    os.chmod(root, 0o711 if shared else 0o700)
    for job in list(root.iterdir()):
        if job.is_symlink() or not job.is_dir():   # the socket of a daemon that crashed, or nothing of ours
            job.unlink(missing_ok=True)
            continue
        try:
            stale = now - job.stat().st_mtime > SNAPSHOT_KEEP_S
        except OSError:
            continue
        if stale:
            shutil.rmtree(job, ignore_errors=True)
            continue
        for epoch in saved_parts.epochs(job):
            shutil.rmtree(saved_parts.epoch_dir(job, epoch), ignore_errors=True)
    return root


def _beat(proc: _Process, now: float) -> Beat | None:
    """The agent's beat file on the daemon's wall clock (`now`); the agent writes CLOCK_MONOTONIC."""
    beat = read_beat(beat_path(str(proc.error_path)))
    return beat and beat.on_clock(now, time.monotonic())


def _error_of(proc: _Process, rank: int, code: int) -> dict[str, Any]:
    """The agent's own error report, or one made up from its exit code and log tail."""
    data = read_regular(proc.error_path, MAX_ERROR_REPORT, owner=proc.uid)
    try:
        err = p.flat_scalars(json.loads(data)) if data else None
        if err:
            return err
    except ValueError:
        pass
    # No report: the agent did not get to say why (a signal, the OOM killer, a crash in native code). Not
    # the user's error as far as anyone can tell, so the scheduler recovers the job.
    # A signal names itself (SIGKILL: the OOM killer, or someone); an exit code with no report needs the hint.
    said = f"agent {rank} {how_it_ended(code)}" + ("" if code < 0 else " and left no error report (killed? out of memory?)")
    return {"message": said,
            "cause": Cause.DIED.value, "exitcode": code, "log_tail": _tail(proc.log_path)}


def _tail(path: Path, limit: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
