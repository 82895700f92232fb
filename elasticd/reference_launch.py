"""Start the real-DDP reference's N ranks (`elasticd run --ddp`; each rank is agent/ddp_reference.py's
`worker`) and wait for them, without importing torch here.

The launcher only binds the rendezvous socket and starts processes: rank 0 hosts the store on that socket
(passed down, so no other process can take the port in between), as rank 0 does under torchrun with
`env://`. Ranks are forked from a fork server of kind "reference" that imported torch and DDP once
(a cold rank pays the interpreter and the torch import, seconds of CPU each); a rank the server cannot
give what a cold start would is started cold (elasticd/forked.py says when).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

from elasticd.core.commands import module_command
from elasticd.core.env_names import torchrun_variables
from elasticd.core.text import say
from elasticd.forked import ForkedProcess, ForkServer, shared_server, supported

_POLL_S = 0.05   # how often the launcher looks at cold ranks' exits
RANK_MODULE = "elasticd.agent.ddp_reference"


def rank_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every rank starts with: ours, `env`, and the settings below (a shared fork server
    of kind "reference" must be started with it, or ranks are not forked from it)."""
    child_env = {**os.environ, **(env or {}), "OMP_NUM_THREADS": "1"}
    child_env.setdefault("GLOO_SOCKET_IFNAME", "lo")  # gloo must not pick an interface other ranks can't reach
    # find_unused_parameters=True makes DDP warn once per rank when every parameter was used.
    child_env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    return child_env


def run_native_ddp(
    script_path: str, func: str | None, workers: int, env: dict[str, str] | None = None, timeout: float = 600
) -> int:
    """Run the script's @elastic function under plain DDP with `workers` gloo processes.

    Returns 0 when every rank returned. When a rank fails the others are killed (they would wait in a
    collective forever) and its exit code is returned; 124 when `timeout` seconds pass first.
    """
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    listener = socket.create_server(("127.0.0.1", 0), backlog=max(128, workers))
    port = listener.getsockname()[1]
    child_env = rank_environment(env)
    forks = ForkServer(child_env, kind="reference", shared=shared_server("reference", child_env)) if supported() else None
    procs: list[subprocess.Popen[bytes] | ForkedProcess] = []
    try:
        for rank in range(workers):
            fds = (listener.fileno(),) if rank == 0 else ()
            argv = ["worker", "--script", script_path, "--rank", str(rank), "--world", str(workers),
                    "--store-port", str(port), "--pg-timeout", str(timeout),
                    *(["--store-fd", str(fds[0])] if fds else []), *(["--func", func] if func else [])]
            # What torchrun --nproc_per_node=workers sets for a rank: a function ported from a torchrun script
            # reads it (the same table elasticd's workers see).
            rank_env = {**child_env, **torchrun_variables(rank, workers, "127.0.0.1", port, run_id="elasticd-ddp")}
            proc = forks.spawn(argv, rank_env, fds) if forks is not None else None
            procs.append(proc if proc is not None else
                         subprocess.Popen([*module_command(RANK_MODULE), *argv], env=rank_env, pass_fds=fds))
            if rank == 0:
                listener.close()   # rank 0 holds it now: a rank 0 that dies takes the store with it
        return _wait_all(procs, forks, timeout)
    finally:
        listener.close()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait()
        if forks is not None:
            forks.close()


def _wait_all(procs: list[subprocess.Popen[bytes] | ForkedProcess], forks: ForkServer | None, timeout: float) -> int:
    """0 when every rank exited 0; else the first failed rank's code (the caller stops the others), 124
    when `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    running = dict(enumerate(procs))
    while running:
        for rank, proc in list(running.items()):
            code = proc.poll()
            if code is None:
                continue
            del running[rank]
            if code != 0:
                print(f"[native ddp] rank {rank} exited with code {code}; stopping the other ranks",
                      file=sys.stderr, flush=True)
                return code if code > 0 else 1
        if not running:
            return 0
        if time.monotonic() > deadline:
            say(f"[native ddp] timed out after {timeout:.0f}s; killing all ranks")
            return 124
        if forks is not None and not forks.broken:
            forks.pump(_POLL_S)   # returns at once when a forked rank's exit is reported
        else:
            time.sleep(_POLL_S)
    return 0
