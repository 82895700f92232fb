"""`elasticd run`: start M agent processes for one job on this machine, no daemon.

Gang semantics: all agents start together; if one fails, its error (logical rank, host, traceback)
is shown and every other agent is stopped, so nothing hangs on a collective that can never finish.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

from agent.config import AgentConfig

log = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_local(script: str, func: str | None, workers: int, devices: int, device_type: str = "cpu",
              threads: int = 0, env: dict[str, str] | None = None, device_memory: int = 0) -> int:
    """Run the job to completion; returns 0, or 1 if a worker failed (its error already printed)."""
    port = free_port()
    child_env = {**os.environ, **(env or {})}
    with tempfile.TemporaryDirectory(prefix="elasticd-run-") as tmp:
        procs: list[subprocess.Popen] = []
        errors = []
        for p in range(devices):
            cfg = AgentConfig(
                script=os.path.abspath(script), func=func, workers=workers, rank=p, world=devices,
                device_type=device_type, device_index=p, master_port=port, threads=threads,
                device_memory=device_memory,
                error_file=os.path.join(tmp, f"agent{p}.json"),
            )
            errors.append(cfg.error_file)
            procs.append(subprocess.Popen([sys.executable, "-m", "agent", *cfg.to_argv()], env=child_env))
        try:
            failed = _wait_first_failure(procs)
        except KeyboardInterrupt:
            _stop(procs)
            raise
        if failed is None:
            return 0
        _stop(procs)
        first = _first_error(errors)
        if first is None:
            print(f"[elasticd] agent {failed} exited with code {procs[failed].returncode} and left no "
                  f"error report (killed? out of memory?)", file=sys.stderr)
        return 1


def _wait_first_failure(procs: list[subprocess.Popen]) -> int | None:
    """Block until every agent exits 0 (None) or one exits non-zero (its index)."""
    live = set(range(len(procs)))
    while live:
        for i in sorted(live):
            code = procs[i].poll()
            if code is None:
                continue
            live.discard(i)
            if code != 0:
                return i
        if live:
            try:
                procs[min(live)].wait(timeout=0.05)
            except subprocess.TimeoutExpired:
                pass
    return None


def _first_error(paths: list[str | None]) -> dict | None:
    for path in paths:
        if path and os.path.exists(path):
            with open(path) as f:
                return json.load(f)
    return None
