"""`python -m elasticd.agent.forkserver FD [KIND]`: imports torch once, then forks `elasticd run`'s agents
(KIND `agent`, the default) or the ranks of a plain-DDP reference run (`reference`, agent/ddp_reference.py:
torch, torch.distributed and DDP imported, none of the agent's patches installed).

`python -m elasticd.agent.forkserver --listen PATH [KIND]` is a server shared by many launchers on one
machine (a test suite's hundreds of `elasticd run`s): it imports once, then forks one server as above for
each launcher that connects to PATH (ELASTICD_FORKSERVER_DIR, elasticd/forked.py). Their agents are not
in the launcher's session or process group, so a signal to the launcher's group does not reach them;
they still end with their launcher, whose end of file ends their server.

An agent started cold pays an interpreter, the torch import and torch's lazy first-optimizer imports
(~4.5 s of CPU on an idle core of this project's machines) before it runs a line of the job; `elasticd run`
on M devices paid that M times at start, again for each joiner of a grow, and again for every agent of a
recovery or a torchrun-mode restart. This process pays it once (the same preload as a daemon's spare,
agent/spare.py) and forks each agent from there, as multiprocessing's forkserver does: a fork of a process
that has imported torch but never computed anything with more than one thread is safe, and no CUDA is
touched before a child knows its device.

A node daemon keeps one too, to fork its spares from (elasticd/daemon/spares.py).

The launcher (elasticd/forked.py) talks to it over a SOCK_SEQPACKET socket pair, one JSON message each way:
    -> {"argv": [...], "env": {...}, "cwd": "...", "fds": [3+ targets]}  with SCM_RIGHTS [0, 1, 2, *fds]
       optionally with "session": true (the child starts a session, as Popen's start_new_session),
       "death_signal": SIG (it gets SIG when this server ends, as PR_SET_PDEATHSIG) and "spare": true (it
       becomes a daemon's spare, agent/spare.py: it waits for its job on stdin instead of running argv)
    <- {"pid": N} with SCM_RIGHTS [pidfd]    or    {"error": "..."}
    <- {"exit": N, "code": C}                 (the child ended; C as subprocess.Popen.returncode)
The child is this process's child (it reaps them and reports their codes), so an agent's parent is this
server: when the launcher goes, the socket's end of file ends the server, and its agents see their parent
change as they would see the launcher's.

A child takes on what a cold `python -P -m elasticd.agent ARGV` started by the launcher would have had:
the launcher's stdio and the passed fds at the numbers ARGV names, nothing else open, the job's env, cwd,
sys.path and sys.argv, random streams drawn from the OS (a fork copies the server's), Python's default
SIGINT handling; it exits through the interpreter's normal shutdown (threads joined, atexit run). What
only takes effect at interpreter start cannot be taken on: the launcher starts agents whose environment
differs there cold (elasticd/startup_env.py).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import selectors
import signal
import socket
import sys
import traceback

MAX_MESSAGE = 1 << 20
MAX_FDS = 64


def _request(data: bytes) -> dict:
    from elasticd.agent.spare import is_job

    job = json.loads(data)
    if not (is_job(job) and isinstance(job.get("fds"), list) and all(isinstance(f, int) and f > 2 for f in job["fds"])
            and isinstance(job.get("spare", False), bool) and isinstance(job.get("session", False), bool)
            and isinstance(job.get("death_signal", 0), int)):
        raise ValueError(f"malformed request: {data[:200]!r}")
    return job


def _send(sock: socket.socket, msg: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(msg).encode()
    try:
        if fds:
            socket.send_fds(sock, [data], fds)
        else:
            sock.send(data)
    except OSError:
        pass   # the launcher is gone; the end of file on the next read ends this server


def _freeze_before_fork() -> None:
    """Move every object this server has to the collector's permanent generation, so that its children's
    collections never visit the some 300,000 objects the imports made (torch and its compiler stack): a
    full collection in a child then walks what the child made, not the server's heap, whose pages it
    would also copy on write. Each resize's collection and the exit's look for open files
    (agent/process_exit.py) are on an agent's critical path."""
    gc.freeze()


class Server:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sel = selectors.DefaultSelector()
        self.sel.register(sock, selectors.EVENT_READ)
        self.children: dict[int, int] = {}   # pid -> our pidfd of it

    def serve(self) -> tuple[dict, list[int]] | None:
        """Serve until the launcher closes the socket (None). In a forked child, return its request and
        fds instead, with everything of the server's closed."""
        # Its environment too: a client that joined a shared server (below) starts agents whose
        # interpreter-start variables differ elsewhere.
        _send(self.sock, {"ready": os.getpid(), "env": dict(os.environ)})
        while True:
            for key, _ in self.sel.select():
                if key.fileobj is self.sock:
                    data, fds, _flags, _addr = socket.recv_fds(self.sock, MAX_MESSAGE, MAX_FDS)
                    if not data:
                        return None
                    child = self._fork(data, fds)
                    if child is not None:
                        return child
                else:
                    self._reap(key.data, key.fileobj)

    def _fork(self, data: bytes, fds: list[int]) -> tuple[dict, list[int]] | None:
        try:
            job = _request(data)
            if len(fds) != 3 + len(job["fds"]):
                raise ValueError(f"{len(fds)} descriptors for {3 + len(job['fds'])} places")
            sys.stdout.flush()
            sys.stderr.flush()
            _freeze_before_fork()
            pid = os.fork()
        except Exception as e:   # noqa: BLE001 - any refusal is the launcher's to report; this server goes on
            for fd in fds:
                os.close(fd)
            _send(self.sock, {"error": f"{type(e).__name__}: {e}"})
            return None
        if pid == 0:
            self.sel.close()
            self.sock.close()
            for pidfd in self.children.values():
                os.close(pidfd)
            return job, fds
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.children[pid] = pidfd
        self.sel.register(pidfd, selectors.EVENT_READ, pid)
        _send(self.sock, {"pid": pid}, [pidfd])
        return None

    def _reap(self, pid: int, pidfd: int) -> None:
        _, status = os.waitpid(pid, 0)
        self.sel.unregister(pidfd)
        os.close(pidfd)
        del self.children[pid]
        _send(self.sock, {"exit": pid, "code": os.waitstatus_to_exitcode(status)})


def _place_fds(fds: list[int], targets: list[int]) -> None:
    """Put stdio and the passed fds where the agent's argv expects them, and close everything else."""
    import fcntl

    # Above every number in play first, so that no dup2 below overwrites a descriptor still to be placed.
    high = max([*targets, *fds, 2]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, high) for fd in fds]
    for fd in fds:
        os.close(fd)
    for src, dst in zip(moved, [0, 1, 2, *targets], strict=True):
        os.dup2(src, dst)   # inheritable, as Popen's pass_fds leaves them
    keep = {0, 1, 2, *targets}
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass   # the listing's own descriptor, closed by now


def _fresh_streams() -> None:
    """Draw the child's global random streams from the OS, as a fresh interpreter does (a fork copies
    the server's). torch keeps a constant start seed where this torch uses one."""
    import torch

    from elasticd.agent.slicer import rng

    rng.seed_from_os(rng.Unseeded(torch=torch.initial_seed() != rng.TORCH_CONSTANT_SEED, python=True, numpy=True))


def _die_with(parent: int, sig: int) -> None:
    """Ask the kernel to send `sig` when this server, our parent, ends (as a daemon's agents are asked
    about the daemon, elasticd/daemon/processes.py); exit if it has ended already."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, sig)   # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(70)


def _become(job: dict, fds: list[int], parent: int, entry: str | None) -> None:
    from elasticd.agent.spare import take_on

    _place_fds(fds, job["fds"])   # sys.stdout and sys.stderr wrap fds 1 and 2, now the launcher's
    if job.get("session"):
        os.setsid()   # as Popen's start_new_session: a signal to the process group reaches its children only
    if job.get("death_signal"):
        _die_with(parent, job["death_signal"])
    take_on(job, entry)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _fresh_streams()


def _preload(kind: str) -> str | None:
    """Import what the children of `kind` run on; the file their sys.argv names (None: the agent's)."""
    if kind == "reference":
        # Plain torch, torch.distributed and DDP: none of the agent's patches may reach the reference.
        import torch

        import elasticd.agent.ddp_reference

        # A rank's first optimizer imports torch's compiler stack (over a CPU-second): once, here. Not
        # agent/process.py's warm_up, the same call: importing that module brings the runtime in.
        torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
        return elasticd.agent.ddp_reference.__file__
    if kind != "agent":
        raise SystemExit(f"elasticd fork server: unknown kind {kind!r} (agent, reference)")
    from elasticd.agent.spare import _preload

    _preload()
    return None


def main(argv: list[str]) -> int:
    if argv[:1] == ["--listen"]:
        return _listen(argv[1], argv[2] if len(argv) > 2 else "agent")
    kind = argv[1] if len(argv) > 1 else "agent"
    entry = _preload(kind)
    # Ctrl-C in the launcher's terminal reaches this process group: the launcher decides what stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return _serve(socket.socket(fileno=int(argv[0])), kind, entry)


def _listen(path: str, kind: str) -> int:
    """A shared server: preload once, then serve each client that connects to `path` from a fork of
    this process of its own (the server a launcher would otherwise start, without the imports). Ends
    when the process that started it does."""
    entry = _preload(kind)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    mask = os.umask(0o177)   # the socket is its owner's alone: a client names argv and env to run
    try:
        listener.bind(path)
    finally:
        os.umask(mask)
    listener.listen(16)
    while os.getppid() == parent:
        if select.select([listener], [], [], 1.0)[0]:
            conn, _ = listener.accept()
            _freeze_before_fork()
            if os.fork() == 0:
                listener.close()
                return _serve(conn, kind, entry)
            conn.close()
        with contextlib.suppress(ChildProcessError):
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
    with contextlib.suppress(OSError):
        os.unlink(path)
    os._exit(0)


def _serve(sock: socket.socket, kind: str, entry: str | None) -> int:
    server = os.getpid()
    child = Server(sock).serve()
    if child is None:
        # The launcher is done with us: nothing here needs an orderly shutdown, which with torch loaded
        # takes about a second that the launcher would wait for.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    job, fds = child
    try:
        _become(job, fds, server, entry)
    except BaseException:   # noqa: BLE001 - a child that cannot become its agent fails as a cold one would
        traceback.print_exc()
        return 1
    if kind == "reference":
        from elasticd.agent.ddp_reference import main as reference_main

        return reference_main(job["argv"])
    if job.get("spare"):
        from elasticd.agent.spare import serve

        return serve("forked ready in 0.0s")
    from elasticd.agent.__main__ import main as agent_main

    return agent_main(job["argv"])


if __name__ == "__main__":
    from elasticd.agent.process_exit import run

    run(lambda: main(sys.argv[1:]))
