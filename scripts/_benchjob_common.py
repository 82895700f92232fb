"""Helpers shared by the benchmark scripts: running `scripts/_benchjob.py` every way, reading what it timed.

Benchmarks here compare variants side by side in one run on a shared, noisy machine, so they report
ratios of medians and the helpers below are about doing that consistently: per-run step time is the
median of the per-step gaps after warm-up (one slow step caused by a neighbour does not move it), and
variants are interleaved by the callers.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from elasticd.agent import proc_name
from elasticd.forked import SHARED_DIR_VAR

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
JOB = SCRIPTS / "_benchjob.py"


# The CPUs this process may use when the benchmark starts; benchmarks that pin themselves to one core
# hand the full set back to the jobs they start (children inherit affinity).
ALL_CPUS = frozenset(os.sched_getaffinity(0))


class BenchError(RuntimeError):
    """A benchmark run failed; carries the command's output so the failure can be read."""


def job_env(**knobs: Any) -> dict[str, str]:
    """`ELASTICD_BENCH_<KNOB>` variables for `_benchjob.py` (see its docstring), on top of os.environ."""
    env = dict(os.environ)
    for k, v in knobs.items():
        env[f"ELASTICD_BENCH_{k.upper()}"] = str(v)
    return env


def own_processes(env: dict[str, str]) -> dict[str, str]:
    """`env` for a run whose agents must be its own children: one the benchmark freezes or pins to cores by
    process tree. A fork server shared through ELASTICD_FORKSERVER_DIR would fork them outside the tree."""
    return {k: v for k, v in env.items() if k != SHARED_DIR_VAR}


def run(cmd: Sequence[str], env: dict[str, str], timeout: float, cpus: frozenset[int] | None = None) -> None:
    """Run a command to completion, quietly; BenchError with its output if it fails or times out.

    `cpus`: the cores the command may use (default: every core the benchmark started with); a pinned run's
    agents are its own children, which inherit the pinning."""
    allowed = ALL_CPUS if cpus is None else cpus
    env = env if cpus is None else own_processes(env)
    try:
        proc = subprocess.run(list(cmd), env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                              preexec_fn=lambda: os.sched_setaffinity(0, allowed))
    except subprocess.TimeoutExpired as e:
        raise BenchError(f"timed out after {timeout:.0f}s: {' '.join(cmd)}\n{e.stdout or ''}{e.stderr or ''}") from None
    if proc.returncode != 0:
        raise BenchError(f"exit {proc.returncode}: {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")


def unpin() -> None:
    """Let a child use every CPU the benchmark started with, even if the benchmark pinned itself."""
    os.sched_setaffinity(0, ALL_CPUS)


def elasticd_cmd(*args: str) -> list[str]:
    """`elasticd ...` through the interpreter running the benchmark (the console script may not be on PATH)."""
    return [sys.executable, "-m", "elasticd", *args]


def process_tree(pid: int) -> list[psutil.Process]:
    """A process and everything it started, parents first ([] once it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def launcher_agents(launcher_pid: int) -> list[psutil.Process]:
    """The job agents an `elasticd run` started (warm standbys excluded), named by rank (agent/proc_name.py)."""
    return [p for rank, p in proc_name.agents_under(launcher_pid) if rank is not None]


def rank_of(agent: psutil.Process) -> int:
    rank = proc_name.rank_of(agent.name())
    if rank is None:
        raise BenchError(f"process {agent.pid} is not a job's agent (named {agent.name()!r})")
    return rank


def out_file(tmp: str, name: str) -> str:
    path = os.path.join(tmp, f"{name}.json")
    if os.path.exists(path):
        os.unlink(path)  # a stale file from an earlier repeat must not pass for this run's result
    return path


def read_json(path: str) -> dict[str, Any]:
    if not os.path.exists(path):
        raise BenchError(f"the job wrote no result to {path}")
    with open(path) as f:
        return json.load(f)


def step_seconds(stamps: Sequence[float], warmup: int) -> float:
    """Median seconds per step from step-start stamps (plus one after the last step), skipping warm-up."""
    gaps = [b - a for a, b in zip(stamps[:-1], stamps[1:], strict=True)][warmup:]
    if not gaps:
        raise BenchError(f"no timed steps: {len(stamps)} stamps, warm-up {warmup}")
    return statistics.median(gaps)


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def load_average() -> str:
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} cores"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain fixed-width table: first column left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths, strict=True)))

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in rows)])


def tempdir() -> tempfile.TemporaryDirectory[str]:
    return tempfile.TemporaryDirectory(prefix="elasticd-bench-")
