"""`python -m agent.spare`: an agent process started before anyone knows which job it will serve.

The node daemon keeps a few of these (elasticd/daemon/spares.py) so that starting an agent, above all a
joiner of a live grow, does not wait for an interpreter to start and torch to import (3-20 s on a busy
node). A spare imports torch and the agent runtime, pays torch's lazy first-optimizer imports, then
blocks on ONE line of JSON from its stdin, a pipe from the daemon:
    {"argv": [...], "env": {...}, "cwd": "...", "log": "..."}
From then on it is that agent: the log file becomes its stdout and stderr, it takes the job's cwd,
environment, `sys.path` and `sys.argv` as `python -m agent ARGV` started there would have had them, and
runs the same entry (agent/__main__.py). Its pid is the agent's pid.

What cannot be changed after start-up stays the spare's: variables read when the interpreter or a
native library starts (PYTHON*, LD_*, MALLOC_*, OpenMP/MKL threads, CUDA_VISIBLE_DEVICES, ...). The
daemon starts agents of jobs that set those cold instead (elasticd/startup_env.py).

Nothing here may initialise CUDA before the assignment: which device the agent gets is not known yet,
and a context created on the wrong device (or before CUDA_VISIBLE_DEVICES applies) cannot be undone.
"""

from __future__ import annotations

import json
import os
import sys
import time

# Captured before anything else runs: the assignment rebuilds sys.path from how this interpreter built it.
_STARTUP_PATH = list(sys.path)
_STARTUP_CWD = os.getcwd()
_STARTUP_PYTHONPATH = os.environ.get("PYTHONPATH", "")


def _preload() -> None:
    """Everything an agent imports and warms up before it knows its job."""
    import torch

    import elasticd.agent.control.zmq_channel  # noqa: F401 - the daemon's control channel (pyzmq; no context, no socket yet)
    from elasticd.agent.compat.torch_dist import install
    from elasticd.agent.process import warm_up

    # The agent installs its torch.distributed patches before anything else imports; so does the spare,
    # so that modules the warm-up imports bind the same objects as in a cold agent.
    install()
    warm_up()
    if torch.cuda.is_initialized():
        raise SystemExit("elasticd spare: CUDA was initialised before an assignment; refusing to serve")


def pythonpath_entries(value: str, cwd: str) -> list[str]:
    """PYTHONPATH's entries as the interpreter puts them in sys.path: absolute from `cwd`, no duplicates."""
    if not value:
        return []
    return list(dict.fromkeys(os.path.abspath(os.path.join(cwd, e)) for e in value.split(os.pathsep)))


def job_sys_path(cwd: str, pythonpath: str) -> list[str]:
    """sys.path as `python -m agent` started in `cwd` with `pythonpath` would have it.

    The directory of `-m` (the cwd) comes first unless the interpreter runs in safe-path mode, then the
    PYTHONPATH entries (relative ones resolve against the cwd at start), then the interpreter's own.
    """
    rest = _STARTUP_PATH
    head: list[str] = []
    if rest and rest[0] == _STARTUP_CWD:
        rest, head = rest[1:], [cwd]
    old = pythonpath_entries(_STARTUP_PYTHONPATH, _STARTUP_CWD)
    if rest[: len(old)] == old:
        rest = rest[len(old):]
    new = pythonpath_entries(pythonpath, cwd)
    return [*head, *new, *(p for p in rest if p not in new)]


def is_job(job: object) -> bool:
    """Whether `job` has what `take_on` reads, of the right types: argv, env and cwd."""
    return (isinstance(job, dict) and isinstance(job.get("argv"), list) and all(isinstance(a, str) for a in job["argv"])
            and isinstance(job.get("env"), dict) and all(isinstance(k, str) and isinstance(v, str)
                                                         for k, v in job["env"].items())
            and isinstance(job.get("cwd"), str))


def _assignment(line: bytes) -> dict:
    job = json.loads(line)
    if not (is_job(job) and isinstance(job.get("log"), str) and _is_user(job.get("user"))):
        raise ValueError(f"malformed assignment: {line[:200]!r}")
    return job


def _is_user(user: object) -> bool:
    """None (stay who we are) or {"uid": int, "gid": int, "groups": [int, ...]}."""
    return user is None or (isinstance(user, dict) and isinstance(user.get("uid"), int)
                            and isinstance(user.get("gid"), int) and isinstance(user.get("groups"), list)
                            and all(isinstance(g, int) for g in user["groups"]))


def _drop_to(user: dict) -> None:
    """Become the job's user for good (the daemon runs as root; the job must not), as Popen(user=...) does
    for an agent started cold. Changing credentials clears the parent-death signal and makes the process
    undumpable: both are set again, the signal only while the parent that started us still lives."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    sig = ctypes.c_int(0)
    libc.prctl(2, ctypes.byref(sig))   # PR_GET_PDEATHSIG
    parent = os.getppid()
    os.setgroups(user["groups"])
    os.setresgid(user["gid"], user["gid"], user["gid"])
    os.setresuid(user["uid"], user["uid"], user["uid"])
    if os.getresuid() != (user["uid"],) * 3:
        raise SystemExit(f"elasticd spare: could not become uid {user['uid']}")
    libc.prctl(4, 1)   # PR_SET_DUMPABLE: its own /proc files, as any process of this user
    if sig.value:
        libc.prctl(1, sig.value)   # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(70)


def _become(job: dict) -> None:
    """Take on the process state a cold `python -m agent` of this job would have started with."""
    sys.stdout.flush()
    sys.stderr.flush()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    if job["log"]:   # "": the output it has, which is the launcher's (an `elasticd run` node)
        out = os.open(job["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
    if job.get("user") is not None:
        _drop_to(job["user"])
    take_on(job)


def take_on(job: dict, entry: str | None = None) -> None:
    """The job's cwd, environment, sys.path and sys.argv, as `python -m elasticd.agent ARGV` started in
    that cwd with that environment would have them (also a forked agent's, agent/forkserver.py); `entry`
    is the file `-m` would run instead (a forked DDP reference rank's)."""
    os.chdir(job["cwd"])
    os.environ.clear()
    os.environ.update(job["env"])
    sys.path[:] = job_sys_path(os.getcwd(), job["env"].get("PYTHONPATH", ""))
    if entry is None:
        import elasticd.agent.__main__

        entry = elasticd.agent.__main__.__file__
    sys.argv = [entry, *job["argv"]]


def main() -> int:
    started = time.monotonic()
    _preload()
    return serve(f"ready in {time.monotonic() - started:.1f}s")


def serve(ready: str) -> int:
    """Wait for one assignment, then be that agent (a cold spare after `_preload`; a daemon's fork server's
    child, agent/forkserver.py, right after the fork)."""
    from elasticd.agent import proc_name
    from elasticd.core.env_names import QUIET_SPARE_VAR

    proc_name.set_name(0, standby=True)
    if os.environ.get(QUIET_SPARE_VAR) != "1":
        from elasticd.core.text import say

        say(f"elasticd spare pid {os.getpid()} {ready}")
    line = sys.stdin.buffer.readline()
    if not line.strip():
        return 0   # the daemon closed the pipe: no job for this spare
    job = _assignment(line)
    _become(job)
    from elasticd.agent.__main__ import main as agent_main

    return agent_main(job["argv"])


if __name__ == "__main__":
    from elasticd.agent.process_exit import run

    run(main)
