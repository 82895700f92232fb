"""A pool of warm spare agent processes (agent/spare.py), so that starting an agent skips Python and torch.

Starting `python -m agent` costs an interpreter start, the torch import and torch's lazy first-optimizer
imports: 5 s on an idle node, 20 s on a loaded one, and a live grow waits for all of it. The node daemon
keeps `size` spares that have paid those costs and wait for one assignment on a pipe; any agent start
(launch or joiner) takes one when the job allows it and starts cold otherwise. The pool keeps one spare
per idle device (a device no agent runs on) and at least one, at most `limit`: a grow onto every idle
device finds all its joiners warm, and the one kept on a busy node is warm for the first grow after a
shrink (a spare started when the shrink frees a device takes seconds to warm up). A taken spare is
replaced at once while that rule wants it.

Every spare is started from the daemon's loop thread, like the agents: PR_SET_PDEATHSIG fires when the
thread that forked the child ends, so a helper thread would kill its spares when it finished.

Costs: each idle spare holds an interpreter with torch imported (a few hundred MB of RSS) and a core for
a few seconds while it starts. Spares that keep dying before they are used are restarted with a
growing delay (logged), not in a loop.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from elasticd.agent import module_command

log = logging.getLogger(__name__)

# Read when an interpreter or a native library starts, so a spare cannot take them on afterwards: the
# Python runtime's own settings, the dynamic loader, glibc malloc, OpenMP/BLAS thread pools, locale,
# which devices CUDA/ROCm enumerate, and torch's import-time switches.
_STARTUP_PREFIXES = ("PYTHON", "LD_", "MALLOC_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "BLIS_",
                     "VECLIB_", "NUMEXPR_", "CUDA_", "HIP_", "ROCR_", "TORCH_", "PYTORCH_", "LC_")
_STARTUP_NAMES = frozenset({"GLIBC_TUNABLES", "LANG", "LANGUAGE", "TZ", "TMPDIR"})
# An assignment goes into an empty pipe whose capacity is at least this on Linux; larger ones start cold
# rather than risk a write that waits for the spare.
_MAX_ASSIGNMENT = 60 * 1024
MAX_BACKOFF_S = 60.0
HEALTHY_S = 60.0   # a spare that lived this long and then died does not count towards a crash loop


def spare_command() -> list[str]:
    return module_command("elasticd.agent.spare")


def startup_differences(env: dict[str, str], spare_env: dict[str, str]) -> list[str]:
    """Variables that only take effect at interpreter start and differ between a job's env and a spare's."""
    keys = env.keys() | spare_env.keys()
    return sorted(k for k in keys if (k in _STARTUP_NAMES or k.startswith(_STARTUP_PREFIXES))
                  and env.get(k) != spare_env.get(k))


@dataclass(eq=False, slots=True)
class Spare:
    popen: subprocess.Popen
    started: float


class SparePool:
    """Up to `size` spares (`want`: one per idle device and at least one, at most `limit`); not
    thread-safe: the daemon's loop owns it (see the module docstring)."""

    def __init__(self, limit: int, env: dict[str, str], cwd: Path, log_path: Path,
                 wrap: Callable[[list[str]], list[str]] = list) -> None:
        """`env`: what a spare starts with (an agent's env without the job's); `wrap(command)` adds the
        death-signal prelude agents are started with; `log_path` takes spares' output until assigned."""
        self.limit = limit
        self.size = limit
        self.env = env
        self.cwd = cwd
        self.log_path = log_path
        self._wrap = wrap
        self.spares: list[Spare] = []
        self._failures = 0
        self._not_before = 0.0
        if limit:
            log.info("keeping a spare agent process warm per idle device, at most %d (%s); their output until "
                     "used: %s", limit, " ".join(spare_command()[1:]), log_path)

    def pids(self) -> list[int]:
        return [s.popen.pid for s in self.spares]

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
            try:
                with open(self.log_path, "ab") as out:
                    popen = subprocess.Popen(self._wrap(spare_command()), stdin=subprocess.PIPE, stdout=out,
                                             stderr=subprocess.STDOUT, cwd=self.cwd, env=self.env,
                                             start_new_session=True)   # its own group, as an agent's
            except OSError as e:
                self._failed(f"cannot start a spare agent: {e}")
                return
            self.spares.append(Spare(popen, now))
            log.debug("spare agent pid %d starting", popen.pid)

    def take(self, argv: list[str], env: dict[str, str], cwd: str, log_path: Path, who: str
             ) -> subprocess.Popen | None:
        """Hand an agent start to a spare: its Popen, now that agent; None means start it cold."""
        if not self.limit:
            return None
        self.size = max(1, self.size - 1)   # the agent takes an idle device: one spare fewer is wanted
        differ = startup_differences(env, self.env)
        if differ:
            log.info("%s: cold start, not a spare: the job sets %s, read only when an interpreter starts",
                     who, ", ".join(differ))
            return None
        line = json.dumps({"argv": argv, "env": env, "cwd": cwd, "log": str(log_path)}).encode() + b"\n"
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
        log.info("%s: cold start: no spare agent ready", who)
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
            _signal(s.popen.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for s in spares:
            try:
                s.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _kill(s.popen)
            if s.popen.stdin is not None:
                s.popen.stdin.close()


def _kill(popen: subprocess.Popen) -> None:
    _signal(popen.pid, signal.SIGKILL)
    popen.wait()


def _signal(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
