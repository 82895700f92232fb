"""A pool of warm spare agent processes (agent/spare.py), so that starting an agent skips Python and torch.

Starting `python -m agent` costs an interpreter start, the torch import and torch's lazy first-optimizer
imports: 5 s on an idle node, 20 s on a loaded one, and a live grow waits for all of it. The node daemon
keeps `size` spares that have paid those costs and wait for one assignment on a pipe; any agent start
(launch or joiner) takes one when the job allows it and starts cold otherwise. The pool keeps one spare
per idle device (a device no agent runs on) and at least one, at most `limit`: a grow onto every idle
device finds all its joiners warm, and the one kept on a busy node is warm for the first grow after a
shrink (a spare started when the shrink frees a device takes seconds to warm up). A taken spare is
replaced at once while that rule wants it.

Spares are forked from one fork server per daemon (agent/forkserver.py, elasticd/forked.py), which pays
the interpreter and torch once: a spare is then ready in milliseconds instead of seconds, the one that
replaces a taken spare no longer takes a core from the training for seconds, and idle spares share the
server's memory until they write to it. Each is a session leader that gets SIGTERM when the server ends,
and the server gets it when the daemon ends (the same PR_SET_PDEATHSIG prelude as agents). Until the
server is ready no spare is started (an agent started meanwhile starts cold; the daemon offers its devices
to the scheduler only once the server is ready and spares are forked, elasticd/daemon/server.py). A daemon whose environment names
a shared fork server (ELASTICD_FORKSERVER_DIR, as `elasticd run` takes one: a test suite's many daemons)
takes its server from there when that one runs as the daemon's user with the agents' start-up environment
(the daemon's own, PYTHONUNBUFFERED=1 added). Without pidfds or with
`ELASTICD_FORKSERVER=0`, or once the server has failed, spares start cold, each `python -m
elasticd.agent.spare` importing torch itself.

Every spare, and the fork server, is started from the daemon's loop thread, like the agents:
PR_SET_PDEATHSIG fires when the thread that forked the child ends, so a helper thread would kill its
spares when it finished.

Costs: the fork server holds an interpreter with torch imported (a few hundred MB of RSS) for the
daemon's life; each idle spare shares most of that (a cold one holds its own and a core for a few seconds
while it starts). Spares that keep dying before they are used are restarted with a growing delay
(logged), not in a loop. A forked agent depends on the server: if the server is killed, its agents get
SIGTERM and their jobs recover as from any agent's death.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from elasticd.core.commands import module_command
from elasticd.daemon.job_user import JobUser
from elasticd.forked import ForkedProcess, ForkServer, shared_server
from elasticd.startup_env import startup_differences

log = logging.getLogger(__name__)

# An assignment goes into an empty pipe whose capacity is at least this on Linux; larger ones start cold
# rather than risk a write that waits for the spare.
_MAX_ASSIGNMENT = 60 * 1024
MAX_BACKOFF_S = 60.0
FORK_REPLY_TIMEOUT_S = 10.0   # the daemon's loop waits this long at most for a fork (milliseconds when well)
HEALTHY_S = 60.0   # a spare that lived this long and then died does not count towards a crash loop


def spare_command() -> list[str]:
    return module_command("elasticd.agent.spare")


@dataclass(eq=False, slots=True)
class Spare:
    popen: subprocess.Popen | ForkedProcess
    started: float


class SparePool:
    """Up to `size` spares (`want`: one per idle device and at least one, at most `limit`); not
    thread-safe: the daemon's loop owns it (see the module docstring)."""

    def __init__(self, limit: int, env: dict[str, str], cwd: Path, log_path: Path | None,
                 wrap: Callable[[list[str]], list[str]] = list, fork: bool = False) -> None:
        """`env`: what a spare starts with (an agent's env without the job's); `wrap(command)` adds the
        death-signal prelude agents are started with; `log_path` takes spares' output until assigned (None:
        this process's stdout and stderr, kept by the agents they become);
        `fork`: fork spares from one fork server instead of starting each cold (module docstring)."""
        self.limit = limit
        self.size = limit
        self.env = env
        self.cwd = cwd
        self.log_path = log_path
        self._wrap = wrap
        self._fork = fork
        self._server: ForkServer | None = None
        self.spares: list[Spare] = []
        self._failures = 0
        self._not_before = 0.0
        if limit:
            how = "forked from one fork server" if fork else " ".join(spare_command()[1:])
            log.info("keeping a spare agent process warm per idle device, at most %d (%s); their output until "
                     "used: %s", limit, how, log_path)

    def pids(self) -> list[int]:
        return [s.popen.pid for s in self.spares]

    def warming(self) -> bool:
        """Whether the fork server is still importing torch (started, not failed, and not ready or no spare
        forked from it yet): an agent started now would start cold and import torch beside it."""
        server = self._server
        return server is not None and not server.broken and (not server.ready() or not self.spares)

    def want(self, idle_devices: int) -> None:
        """How many devices no agent runs on: the pool follows it (at least one, at most `limit`)."""
        self.size = min(self.limit, max(1, idle_devices))

    def replenish(self) -> None:
        """Forget dead spares, stop surplus ones, start new ones up to `size` (unless backing off). Never
        blocks for long: a surplus spare only waits on a pipe, so it dies at once."""
        for s in [s for s in self.spares if s.popen.poll() is not None]:
            self.spares.remove(s)
            self._died(s)
        while len(self.spares) > self.size:
            surplus = self.spares.pop()   # the newest: the least likely to be warm yet
            log.debug("spare agent pid %d stopped: no idle device for it", surplus.popen.pid)
            _kill(surplus.popen)
        now = time.monotonic()
        while len(self.spares) < self.size and now >= self._not_before:
            server = self._fork_server()
            if server is not None and not server.ready():
                return   # still importing torch: spares are forked once it is up, cold ones only if it fails
            popen = self._forked(server) if server is not None else None
            if popen is None:
                try:
                    with self._output() as (out, err):
                        popen = subprocess.Popen(self._wrap(spare_command()), stdin=subprocess.PIPE, stdout=out,
                                                 stderr=err, cwd=self.cwd, env=self.env,
                                                 start_new_session=True)   # its own group, as an agent's
                except OSError as e:
                    self._failed(f"cannot start a spare agent: {e}")
                    return
            self.spares.append(Spare(popen, now))
            log.debug("spare agent pid %d %s", popen.pid, "forked" if isinstance(popen, ForkedProcess) else "starting")

    @contextlib.contextmanager
    def _output(self) -> Iterator[tuple[IO[bytes] | None, int | IO[bytes] | None]]:
        """A spare's stdout and stderr, as Popen takes them: the spares' log, or (None) this process's."""
        if self.log_path is None:
            yield None, None
            return
        with open(self.log_path, "ab") as out:
            yield out, subprocess.STDOUT

    def _fork_server(self) -> ForkServer | None:
        """The fork server (started at the first call, from the loop's thread as spares are); None when
        spares start cold, or the server failed (it logged why)."""
        if not self._fork:
            return None
        if self._server is None:
            try:
                with self._output() as (out, _):
                    self._server = ForkServer(self.env, cwd=str(self.cwd), stdout=out, wrap=self._wrap, session=True,
                                              reply_timeout_s=FORK_REPLY_TIMEOUT_S,
                                              shared=shared_server("agent", os.environ))
            except OSError as e:
                log.warning("cannot start the spares' fork server (%s); spares start cold", e)
                self._fork = False
                return None
            log.info("spares' fork server pid %d starting", self._server.pid)
        return None if self._server.broken else self._server

    def _forked(self, server: ForkServer) -> ForkedProcess | None:
        """A spare forked from `server`, reading its assignment from a pipe as a cold one does; None: the
        server failed (it logged why), start one cold."""
        read, write = os.pipe()
        try:
            with self._output() as (out, _):
                stdio = [read, out.fileno(), out.fileno()] if out is not None else [read, 1, 2]
                proc = server.spawn([], self.env, [], stdio=stdio, cwd=str(self.cwd),
                                    options={"spare": True, "session": True, "death_signal": int(signal.SIGTERM)})
        finally:
            os.close(read)
        if proc is None:
            os.close(write)
            return None
        proc.stdin = os.fdopen(write, "wb")
        return proc

    def take(self, argv: list[str], env: dict[str, str], cwd: str, log_path: Path | None, who: str,
             user: JobUser | None = None) -> subprocess.Popen | None:
        """Hand an agent start to a spare: its Popen, now that agent; None means start it cold. `user`: the
        spare becomes that user once it has opened its log (agent/spare.py), before any of the job's code."""
        if not self.limit:
            return None
        self.size = max(1, self.size - 1)   # the agent takes an idle device: one spare fewer is wanted
        differ = startup_differences(env, self.env)
        if differ:
            log.info("%s: cold start, not a spare: the job sets %s, read only when an interpreter starts",
                     who, ", ".join(differ))
            return None
        job = {"argv": argv, "env": env, "cwd": cwd, "log": str(log_path) if log_path is not None else ""}
        if user is not None:
            job["user"] = {"uid": user.uid, "gid": user.gid, "groups": list(user.groups)}
        line = json.dumps(job).encode() + b"\n"
        if len(line) > _MAX_ASSIGNMENT:
            log.info("%s: cold start, not a spare: its environment is too large for the pipe (%d bytes)",
                     who, len(line))
            return None
        while self.spares:
            spare = self.spares.pop(0)   # the oldest: the likeliest to be warm already
            if self._assign(spare, line):
                log.info("%s: started on spare agent pid %d (started %.1fs ago)", who, spare.popen.pid,
                         time.monotonic() - spare.started)
                self._failures = 0
                self.replenish()
                return spare.popen
        starting = self._server is not None and not self._server.broken and not self._server.ready()
        log.info("%s: cold start: no spare agent ready%s", who,
                 " (the spares' fork server is still importing torch)" if starting else "")
        self.replenish()
        return None

    def _assign(self, spare: Spare, line: bytes) -> bool:
        stdin = spare.popen.stdin
        assert stdin is not None
        if spare.popen.poll() is not None:
            self._died(spare)
            return False
        try:
            os.set_blocking(stdin.fileno(), False)   # the loop must not wait on a spare
            written = os.write(stdin.fileno(), line)
        except BlockingIOError:
            written = 0
        except OSError:   # it died since poll(): nobody reads the pipe any more
            written = -1
        try:
            stdin.close()
        except OSError:
            pass
        if written == len(line):
            return True
        _kill(spare.popen)   # half an assignment, or none: it must not run anything
        if written < 0:
            self._died(spare)
        return False

    def _died(self, spare: Spare) -> None:
        lived = time.monotonic() - spare.started
        if lived >= HEALTHY_S:
            self._failures = 0
        self._failed(f"spare agent pid {spare.popen.pid} exited with code {spare.popen.poll()} after "
                     f"{lived:.1f}s, before it was used (its output: {self.log_path})")

    def _failed(self, why: str) -> None:
        self._failures += 1
        delay = min(MAX_BACKOFF_S, 2.0 ** (self._failures - 1))
        self._not_before = time.monotonic() + delay
        log.warning("%s; next spare in %.0fs", why, delay)

    def shutdown(self, timeout_s: float) -> None:
        """Stop every spare: SIGTERM (they only wait on a pipe), SIGKILL after `timeout_s`."""
        spares, self.spares, self.size, self.limit = self.spares, [], 0, 0
        for s in spares:
            signal_group(s.popen, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for s in spares:
            try:
                s.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill(s.popen)
            if s.popen.stdin is not None:
                s.popen.stdin.close()

    def close(self) -> None:
        """End the fork server, once no agent forked from it runs any more (they would get SIGTERM)."""
        if self._server is not None:
            self._server.close()


def _kill(popen: subprocess.Popen | ForkedProcess) -> None:
    signal_group(popen, signal.SIGKILL)
    popen.wait()


def signal_group(popen: subprocess.Popen | ForkedProcess, sig: int) -> None:
    """Signal the process group an agent or spare leads (its session: a signal reaches its children too).
    A forked one is reaped by its server as soon as it ends, after which its pid can be another process's."""
    if not (isinstance(popen, ForkedProcess) and popen.exited()):
        signal_pid_group(popen.pid, sig)


def signal_pid_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass

