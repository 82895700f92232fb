"""Start agents by forking one warm process (agent/forkserver.py) instead of cold: `elasticd run`'s
agents, a node daemon's spares (elasticd/daemon/spares.py), and the ranks of `elasticd run --ddp`'s
plain-DDP reference (a server of its own, without the agent's patches).

`ForkServer.spawn` returns a `ForkedProcess`, which the caller handles as the `subprocess.Popen` it
would otherwise have (poll, wait, send_signal, kill, pid, returncode), or None: start that agent cold.
It says None where a fork could not give the agent what a cold start would: the job's environment differs
from the server's in a variable read only at interpreter start, the platform has no pidfds or descriptor
passing, the server failed to start, or `ELASTICD_FORKSERVER=0`.

Signals go through a pidfd, never a bare pid: the server reaps its children at once, so a pid alone
could name a process that took a dead agent's number. A signal to a forked process's group (the daemon's
agents lead their own) is sent only while `exited` says, from the pidfd, that the process still runs.
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

from elasticd.core.commands import module_command
from elasticd.startup_env import startup_differences

log = logging.getLogger(__name__)

ENABLE_VAR = "ELASTICD_FORKSERVER"
# A directory holding shared servers' sockets, `KIND.sock` (agent/forkserver.py --listen): a launcher
# takes its server from there instead of starting one and paying torch's import.
SHARED_DIR_VAR = "ELASTICD_FORKSERVER_DIR"
JOIN_TIMEOUT_S = 60.0   # a shared server forks at once; this only bounds a wedged one
READY_TIMEOUT_S = 600.0   # the server imports torch: seconds, minutes on a badly overloaded machine
MAX_MESSAGE = 1 << 20
# The server died under its children: they see their parent change and stop, with codes we never learn.
LOST_CODE = 1


def supported() -> bool:
    return (sys.platform == "linux" and hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")
            and hasattr(socket, "send_fds") and os.environ.get(ENABLE_VAR, "1") != "0")


def shared_server(kind: str, env: Mapping[str, str] = os.environ) -> str:
    """The socket of the shared server of `kind` named by `env`'s ELASTICD_FORKSERVER_DIR, or ""."""
    where = env.get(SHARED_DIR_VAR, "")
    return os.path.join(where, f"{kind}.sock") if where else ""


class ForkedProcess:
    """An agent forked by the server: the part of `subprocess.Popen`'s interface the launcher uses."""

    def __init__(self, server: ForkServer, args: list[str], pid: int, pidfd: int) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self.stdin: IO[bytes] | None = None   # as Popen's stdin=PIPE: set by whoever passed the pipe's other end
        self._server = server
        self._pidfd: int | None = pidfd

    def _ended(self, code: int) -> None:
        self.returncode = code
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._server.pump(0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._server.pump(min(left, 1.0))
        return self.returncode

    def exited(self) -> bool:
        """Whether it has ended (its code may not have been reported yet): until then its pid, and its
        process group if it leads one, are its own, and a signal to them cannot reach another process."""
        if self.returncode is not None or self._pidfd is None:
            return True
        return bool(select.select([self._pidfd], [], [], 0)[0])

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, sig)
            except ProcessLookupError:
                pass   # exited; its code is on its way

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """One fork server for one launcher or daemon: started at once (it imports torch meanwhile), used at
    the first spawn, closed with `close` (its end of file ends it)."""

    def __init__(self, env: Mapping[str, str], *, cwd: str | None = None, stdout: IO[bytes] | None = None,
                 wrap: Callable[[list[str]], list[str]] = list, session: bool = False,
                 reply_timeout_s: float = READY_TIMEOUT_S, kind: str = "agent", shared: str = "") -> None:
        """The server runs `wrap(command)` in `cwd` with `env`, its output to `stdout` (default: ours),
        in a session of its own if `session`; it forks agents, or DDP reference ranks if `kind` is
        "reference". A fork it does not report within `reply_timeout_s` breaks it. `shared`: the socket
        of a shared server of that kind (`shared_server`) to take a server from instead of starting one,
        used when it answers and its interpreter-start environment is `env`'s."""
        self.env = dict(env)
        self.reply_timeout_s = reply_timeout_s
        self.broken = ""   # why no more forks: the launcher starts agents cold from then on
        self._ready = False
        self._children: dict[int, ForkedProcess] = {}
        # A child can end before `spawn` has read its pid: its exit comes in the same read as the pid reply.
        self._early_exits: dict[int, int] = {}   # pid -> code, for children not registered yet
        self._replies: list[tuple[dict, list[int]]] = []
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid = 0
        if shared and self._join(shared):
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = ours
        self._proc = subprocess.Popen(wrap([*module_command("elasticd.agent.forkserver"), str(theirs.fileno()), kind]),
                                      env=self.env, cwd=cwd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                                      stdout=stdout, stderr=None if stdout is None else subprocess.STDOUT,
                                      start_new_session=session)
        theirs.close()

    def _join(self, path: str) -> bool:
        """Take a server from the shared one at `path`; False (nothing held) where it cannot serve us."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.connect(path)
            # Our own user's server only: a client hands its server the job's environment and descriptors.
            _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.geteuid():
                raise PermissionError(f"it runs as uid {uid}, not as ours")
        except OSError as e:
            sock.close()
            log.info("the shared fork server at %s did not answer (%s); starting one", path, e)
            return False
        self._sock = sock
        reply = self._await("ready", JOIN_TIMEOUT_S)
        differ = startup_differences(self.env, reply[0].get("env", {})) if reply is not None else []
        if reply is None or differ:
            log.info("not using the shared fork server at %s: %s", path,
                     self.broken or f"{', '.join(differ)} differ from its environment")
            sock.close()
            self.broken, self._ready, self._replies = "", False, []
            return False
        self._pid = int(reply[0]["ready"])
        return True

    @property
    def pid(self) -> int:
        return self._proc.pid if self._proc is not None else self._pid

    def ready(self) -> bool:
        """Whether it has imported torch and takes requests; never waits (a daemon's loop asks)."""
        if not self._ready and not self.broken:
            self.pump(0.0)
            if self._replies and "ready" in self._replies[0][0]:
                self._replies.pop(0)
                self._ready = True
        return self._ready and not self.broken

    def spawn(self, argv: Sequence[str], env: Mapping[str, str], pass_fds: Sequence[int], *,
              stdio: Sequence[int] | None = None, cwd: str | None = None,
              options: Mapping[str, object] | None = None) -> ForkedProcess | None:
        """Fork an agent running `argv` with `env` in `cwd` (default: ours), `pass_fds` at their own numbers
        and `stdio` (default: ours) as its 0, 1 and 2; `options` are the request's optional fields
        (agent/forkserver.py). Waits for the server to be ready. None: start it cold."""
        if self.broken:
            return None
        differ = startup_differences(dict(env), self.env)
        if differ:
            log.info("starting an agent cold: %s differ from the fork server's environment and only take "
                     "effect when an interpreter starts", ", ".join(differ))
            return None
        if not self._ready and not self._await("ready", READY_TIMEOUT_S):
            return None
        request = {"argv": list(argv), "env": dict(env), "cwd": cwd or os.getcwd(), "fds": list(pass_fds),
                   **(options or {})}
        if stdio is None:
            stdio = mine = [fd if _is_open(fd) else os.open(os.devnull, os.O_RDWR) for fd in (0, 1, 2)]
        else:
            mine = []
        try:
            socket.send_fds(self._sock, [json.dumps(request).encode()], [*stdio, *pass_fds])
        except OSError as e:
            self._break(f"could not reach it ({e})")
            return None
        finally:
            for fd in mine:
                if fd > 2:
                    os.close(fd)
        reply = self._await("pid", self.reply_timeout_s)
        if reply is None:
            return None
        msg, fds = reply
        proc = ForkedProcess(self, list(argv), int(msg["pid"]), fds[0])
        code = self._early_exits.pop(proc.pid, None)
        if code is None:
            self._children[proc.pid] = proc
        else:
            proc._ended(code)
        return proc

    def pump(self, timeout: float) -> None:
        """Take in what the server said within `timeout` seconds: children's exits, replies."""
        if self.broken:
            self._reap_orphans()
            return
        wait = max(timeout, 0.0)
        while select.select([self._sock], [], [], wait)[0]:
            wait = 0.0
            try:
                data, fds, _flags, _addr = socket.recv_fds(self._sock, MAX_MESSAGE, 4)
            except OSError as e:
                self._break(f"its socket failed ({e})")
                return
            if not data:
                self._break("it exited")
                return
            msg = json.loads(data)
            if "exit" in msg:
                child = self._children.pop(int(msg["exit"]), None)
                if child is not None:
                    child._ended(int(msg["code"]))
                else:
                    self._early_exits[int(msg["exit"])] = int(msg["code"])
            else:
                self._replies.append((msg, fds))

    def _await(self, key: str, timeout_s: float) -> tuple[dict, list[int]] | None:
        deadline = time.monotonic() + timeout_s
        while not self.broken:
            if self._replies:
                msg, fds = self._replies.pop(0)
                if key in msg:
                    self._ready = True
                    return msg, fds
                for fd in fds:
                    os.close(fd)
                if "error" in msg:
                    log.warning("the fork server refused an agent (%s); starting it cold", msg["error"])
                    return None
                self._break(f"it sent {msg!r} where {key!r} was due")
                return None
            left = deadline - time.monotonic()
            if left <= 0:
                self._break(f"no {key!r} from it in {timeout_s:.0f}s")
                return None
            self.pump(min(left, 1.0))
        return None

    def _break(self, why: str) -> None:
        if not self.broken:
            self.broken = why
            log.warning("elasticd fork server: %s; agents start cold from now on", why)
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()

    def _reap_orphans(self) -> None:
        for pid, child in list(self._children.items()):
            fd = child._pidfd
            if fd is None or select.select([fd], [], [], 0)[0]:
                del self._children[pid]
                child._ended(LOST_CODE)

    def close(self, timeout_s: float = 10.0) -> None:
        """End the server (its agents should be gone by now: those still running see their parent go)."""
        self._sock.close()
        if self._proc is not None:
            try:
                self._proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for child in self._children.values():
            if child._pidfd is not None:
                os.close(child._pidfd)
                child._pidfd = None


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True
