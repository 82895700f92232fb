"""Moving a job spanning two islands off a drained node live, beside moving a job on one island off one.

The job is scripts/_benchjob.py (an MLP on synthetic data, N=8 logical workers) on 4 CPU devices in both
set-ups, everything on loopback TCP with CURVE:

- one island: a scheduler with two node daemons of 2 devices each (`--min-devices 2`); `elasticd drain n2`
  and the island's scheduler shrinks the job live onto n1 (elasticd/scheduler/draining.py);
- two islands: a federation front, two island schedulers, one node of 2 devices each, the job submitted
  with `--islands A,B`; `elasticd drain b1` on island B, which asks the front for the ranks there, and the
  front shrinks the whole job live onto island A (elasticd/federation/moves.py).

Both are the same 4 -> 2 shrink at a step boundary, the agents that leave handing their workers over to
those that stay. The figures are the stall (rank 0's own time from its last step before the move to its
first after it, as the job's resize history keeps it) and the wall time from the drain command to the
move done. Rounds alternate which set-up runs first.

The last line is `island_move_vs_node_move=X.XX`: the median stall of the two-island move over the
one-island move's.
"""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path

from _benchdaemon import wait_for
from _benchislands import WORKERS, Procs, alternating, ask, env_args
from _benchjob_common import JOB, BenchError, load_average, median, table

from elasticd import protocol as pr


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="rounds of both set-ups (default 3)")
    ap.add_argument("--quick", action="store_true", help="smoke run: one round")
    a = ap.parse_args()
    if a.quick:
        a.repeats = 1
    return a


def _moved(job, devices: int):
    """The job's newest resize, once one to `devices` is done (None before)."""
    if job.state in ("failed", "stopped", "finished"):
        raise BenchError(f"job {job.job_id} {job.state}: {job.error}")
    last = job.resizes[-1] if job.resizes else None
    return last if last is not None and last.outcome == "done" and last.dst == devices else None


def one_island(root: Path, steps: int) -> tuple[float, float]:
    p = Procs(root, 10.0)
    try:
        p.one_island()
        sd = str(root / "sched")
        job = p.cli("submit", f"{JOB}:train", "--workers", str(WORKERS), "--min-devices", "2", "--max-devices", "4",
                    "--snapshot-every", "0", "--state-dir", sd, *env_args(steps)).strip()

        def info():
            return ask(root / "sched" / "scheduler.sock", pr.Status(job_id=job)).jobs[0]

        wait_for(lambda: info().devices == 4 and info().step >= 5, 120, "a few steps on 4 devices")
        asked = time.time()
        p.cli("drain", "n2", "--state-dir", sd)
        entry = wait_for(lambda: _moved(info(), 2), 120, "the job to move off n2", interval=0.02)
        return entry.stall, time.time() - asked
    finally:
        p.close()


def two_islands(root: Path, steps: int) -> tuple[float, float]:
    p = Procs(root, 10.0)
    try:
        p.two_islands()
        fsock = root / "front" / "federation.sock"
        span = p.cli("submit", f"{JOB}:train", "--workers", str(WORKERS), "--islands", "A,B", "--snapshot-every",
                     "0", "--state-dir", str(root / "front"), *env_args(steps)).strip()

        def front():
            return ask(fsock, pr.ListSpans(span_id=span)).spans[0]

        def portion_a():
            return ask(root / "A" / "scheduler.sock", pr.Status()).jobs[-1]

        wait_for(lambda: front().state == "running" and portion_a().step >= 5, 120, "a few steps across both islands")
        asked = time.time()
        p.cli("drain", "b1", "--state-dir", str(root / "B"))
        wait_for(lambda: front().state == "running" and len(front().portions) == 1, 120,
                 "the front to move the job off b1", interval=0.02)
        took = time.time() - asked
        # The resize history of the portion hosting rank 0 (A's), as its island records the move.
        entry = wait_for(lambda: _moved(portion_a(), 2), 30, "A's record of the move")
        return entry.stall, took
    finally:
        p.close()


def main() -> None:
    names = ("one island, node drained", "two islands, island B's node drained")
    rows, stalls = [], {n: [] for n in names}
    steps = 100_000   # never ends on its own: each round ends with its set-up
    for r, name, (stall, took) in alternating(ARGS.repeats, list(zip(names, (one_island, two_islands), strict=True)),
                                              steps):
        if stall is None:
            raise BenchError(f"{name}: the move's record has no stall")
        stalls[name].append(stall)
        rows.append([str(r), name, f"{stall:.3f}", f"{took:.2f}"])
        print(f"round {r}: {name}: stall {stall:.3f}s, drain -> moved {took:.2f}s", flush=True)
    print(table(["round", "set-up", "stall (s)", "drain -> moved (s)"], rows))
    print(f"4 -> 2 devices, N={WORKERS}; {load_average()}")
    one, two = median(stalls[names[0]]), median(stalls[names[1]])
    print(f"median stall: one island {one:.3f}s, two islands {two:.3f}s")
    print(f"island_move_vs_node_move={two / one:.2f}")


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ARGS = _parse()
    main()
