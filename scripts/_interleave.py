"""Run several benchmark jobs at once, frozen and thawed in turns, so each one's steps are timed in slices
interleaved with the others'.

On this shared machine a neighbour slows everything by 20-50% for seconds at a time, so two runs one after
the other (even alternating, even in many rounds) differ by more than the few percent a comparison must
resolve. Here every job is started at once and set up side by side, its warm-up steps included, until each waits at
its first timed step (`_benchjob._await_go`); then the driver lets one run at a time: all the processes of the others are
stopped (SIGSTOP, the whole process tree) while it runs for `slice_s` seconds, then the next one gets
the machine. A slow stretch of a few seconds then falls on every job's slices alike.

Only the step gaps that lie wholly inside one of the job's own slices are kept (a gap that a freeze cut
is discarded), and only from the window in which every job was stepping (a job that starts stepping
early, or goes on alone at the end, would be timed in a stretch its rivals were not). The jobs stamp step starts with `time.perf_counter()`
(`_benchjob._stamp`), the system-wide monotonic clock, the same clock the driver's slices are read on.
"""

from __future__ import annotations

import glob
import os
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import psutil
from _benchjob_common import ALL_CPUS, REPO, BenchError, own_processes, process_tree, read_json


@dataclass
class Job:
    name: str
    cmd: Sequence[str]
    env: dict[str, str]
    out: str                                       # where the job's rank 0 writes its stamps (JSON)
    cpus: frozenset[int] = ALL_CPUS                # the cores it may use
    proc: subprocess.Popen | None = None
    log: tempfile._TemporaryFileWrapper | None = None   # its output (a pipe could fill and block it)
    slices: list[tuple[float, float]] = field(default_factory=list)
    ended: float | None = None


def _kill(proc: subprocess.Popen) -> None:
    """The job and what it started (agents, DDP ranks): none may outlive a failed benchmark."""
    for p in reversed(process_tree(proc.pid)):
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait()


def _signal(proc: subprocess.Popen, sig: int) -> None:
    for p in process_tree(proc.pid):
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _failed(j: Job) -> str:
    assert j.proc is not None and j.log is not None
    j.log.seek(0)
    return f"{j.name}: exit {j.proc.returncode}: {' '.join(j.cmd)}\n{j.log.read()}"


def run_interleaved(jobs: list[Job], slice_s: float = 1.5, timeout: float = 1200.0, go_at: int = 0) -> None:
    """Run `jobs` to completion in turns of `slice_s` seconds; fills each job's `slices` and `ended`.
    Each job runs its steps before `go_at` on its own, and waits before that step for its first turn."""
    gate = tempfile.TemporaryDirectory(prefix="elasticd-bench-go-")
    go = {j.name: os.path.join(gate.name, f"go{i}") for i, j in enumerate(jobs)}
    for j in jobs:
        j.log = tempfile.TemporaryFile("w+")
        env = own_processes({**j.env, "ELASTICD_BENCH_GO": go[j.name], "ELASTICD_BENCH_GO_AT": str(go_at)})
        j.proc = subprocess.Popen(list(j.cmd), env=env, cwd=REPO,
                                  stdout=j.log, stderr=subprocess.STDOUT,
                                  preexec_fn=lambda cpus=j.cpus: os.sched_setaffinity(0, cpus))
    deadline = time.monotonic() + timeout
    turn = 0
    try:
        waiting = list(jobs)
        while waiting:
            for j in list(waiting):
                assert j.proc is not None
                if glob.glob(go[j.name] + ".ready.*"):
                    waiting.remove(j)
                elif j.proc.poll() is not None:
                    raise BenchError(f"before its first step: {_failed(j)}")
            if time.monotonic() > deadline:
                raise BenchError(f"jobs {[j.name for j in waiting]} not ready after {timeout:.0f}s")
            time.sleep(0.05)
        for j in jobs:
            assert j.proc is not None
            _signal(j.proc, signal.SIGSTOP)
        for path in go.values():
            open(path, "w").close()
        while True:
            live = [j for j in jobs if j.ended is None]
            if not live:
                break
            if time.monotonic() > deadline:
                raise BenchError(f"interleaved jobs {[j.name for j in live]} still running after {timeout:.0f}s")
            j = live[turn % len(live)]
            turn += 1
            assert j.proc is not None
            _signal(j.proc, signal.SIGCONT)
            start = time.perf_counter()
            try:
                j.proc.wait(timeout=slice_s)
                j.ended = time.perf_counter()
            except subprocess.TimeoutExpired:
                pass
            _signal(j.proc, signal.SIGSTOP)   # children may have started during the slice: the tree again
            j.slices.append((start, time.perf_counter()))
    finally:
        for j in jobs:
            if j.proc is not None and j.proc.poll() is None:
                _signal(j.proc, signal.SIGCONT)
                _kill(j.proc)
        gate.cleanup()
    for j in jobs:
        assert j.proc is not None and j.log is not None
        if j.proc.returncode != 0:
            raise BenchError(_failed(j))
        j.log.close()


def clean_gaps(jobs: list[Job], warmup: int) -> dict[str, list[float]]:
    """Each job's step gaps after `warmup` that lie inside one of its slices, within the window where
    every job was past its warm-up and not yet done."""
    stamps = {j.name: read_json(j.out)["stamps"] for j in jobs}
    start = max(s[min(warmup, len(s) - 1)] for s in stamps.values())
    end = min(s[-1] for s in stamps.values())
    out: dict[str, list[float]] = {}
    for j in jobs:
        s = stamps[j.name]
        gaps = []
        for a, b in list(zip(s[:-1], s[1:], strict=True))[warmup:]:
            if start <= a and b <= end and any(lo <= a and b <= hi for lo, hi in j.slices):
                gaps.append(b - a)
        out[j.name] = gaps
    return out


def compare(jobs: list[Job], warmup: int, slice_s: float = 1.5) -> dict[str, float]:
    """Run `jobs` interleaved; each one's median clean step gap in seconds.

    Raises:
        BenchError: a job failed, or fewer than 5 of its steps fell inside its slices (slices too short
        for its steps, or too few steps for the jobs to overlap: give it more steps).
    """
    run_interleaved(jobs, slice_s, go_at=warmup)
    gaps = clean_gaps(jobs, warmup)
    thin = {name: len(g) for name, g in gaps.items() if len(g) < 5}
    if thin:
        turns = {j.name: len(j.slices) for j in jobs}
        raise BenchError(f"too few steps timed inside their slices: {thin} (turns each: {turns}); "
                         "run more steps or longer slices")
    return {name: statistics.median(g) for name, g in gaps.items()}
