"""Losing a whole island under a job spanning two, beside losing one node under a job on one island.

The job is scripts/_benchjob.py (an MLP on synthetic data, N=8 logical workers, SGD with momentum,
`--snapshot-every K` steps) on 4 CPU devices in both set-ups, everything on loopback TCP with CURVE:

- one island: a scheduler with two node daemons of 2 devices each (`--min-devices 2`); once a periodic
  snapshot is complete, the second node's daemon and its agents are SIGKILLed. The island's scheduler
  recovers the job on the node left (elasticd/scheduler/recovery.py);
- two islands: a federation front, two island schedulers, one node of 2 devices each, the job submitted
  with `--islands A,B`; island B's scheduler, daemon and agents are SIGKILLed. The front restarts the job on
  island A alone from its newest complete snapshot, whose parts of B's workers A holds as copies
  (elasticd/federation/spans.py).

Both wait for the same silence before they act: the node timeout of the one, the island timeout of the
other (both `--timeout`), with heartbeats every 0.1 s. The figure is wall time from the kill to the
first step the job completes after it (its step moving past the one its restart first reported, read
from the scheduler's and the front's status every 0.02 s). Rounds alternate which set-up runs first.

The last line is `island_loss_vs_node_loss=X.XX`: the median resume time of the two-island job over the
one-island job's.
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
    ap.add_argument("--every", type=int, default=5, help="K: a periodic snapshot every K steps (default 5)")
    ap.add_argument("--timeout", type=float, default=2.0, help="node and island timeout, seconds (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of both set-ups (default 3)")
    ap.add_argument("--quick", action="store_true", help="smoke run: one round")
    a = ap.parse_args()
    if a.quick:
        a.repeats = 1
    return a


def _snapshot(job) -> bool:
    if job.state in ("failed", "stopped"):
        raise BenchError(f"job {job.job_id} {job.state}: {job.error}")
    return (job.snapshot or {}).get("step", 0) >= ARGS.every


def _resumed(read, killed_at: float) -> float:
    """Seconds from the kill to the first step the restarted job completes. `read()`: the job's (state, step)."""
    def seen(pred, what: str):
        while not (got := pred(read())):
            if time.time() - killed_at > 120:
                raise BenchError(f"no {what} within 120 s of the kill")
            time.sleep(0.02)
        return got
    seen(lambda st: st[0] != "running" or None, "sign of the failure")
    (first,) = seen(lambda st: (st[1],) if st[0] == "running" else None, "restart")
    seen(lambda st: st[0] == "running" and st[1] > first, "step after the restart")
    return time.time() - killed_at


def one_island(root: Path, steps: int) -> float:
    p = Procs(root, ARGS.timeout)
    try:
        p.one_island()
        sd = str(root / "sched")
        job = p.cli("submit", f"{JOB}:train", "--workers", str(WORKERS), "--min-devices", "2", "--max-devices", "4",
                    "--snapshot-every", str(ARGS.every), "--state-dir", sd, *env_args(steps)).strip()

        def info():
            return ask(root / "sched" / "scheduler.sock", pr.Status(job_id=job)).jobs[0]

        wait_for(lambda: _snapshot(info()) and info().devices == 4, 120, "a periodic snapshot on 4 devices")
        killed_at = time.time()
        p.kill("n2")
        return _resumed(lambda: (info().state, info().step), killed_at)
    finally:
        p.close()


def two_islands(root: Path, steps: int) -> float:
    p = Procs(root, ARGS.timeout)
    try:
        p.two_islands()
        fsock = root / "front" / "federation.sock"
        span = p.cli("submit", f"{JOB}:train", "--workers", str(WORKERS), "--islands", "A,B", "--snapshot-every",
                     str(ARGS.every), "--state-dir", str(root / "front"), *env_args(steps)).strip()

        def portion_a():
            return ask(root / "A" / "scheduler.sock", pr.Status()).jobs[-1]   # its newest: the restart's

        def read() -> tuple[str, int]:
            s = ask(fsock, pr.ListSpans(span_id=span)).spans[0]
            return (s.state, portion_a().step) if s.state == "running" else (s.state, -1)

        wait_for(lambda: _snapshot(portion_a()), 120, "a periodic snapshot")
        killed_at = time.time()
        p.kill("B", "b1")
        return _resumed(read, killed_at)
    finally:
        p.close()


def main() -> None:
    rows, times = [], {"one island, node lost": [], "two islands, island lost": []}
    steps = 100_000   # never ends on its own: each round kills it
    setups = [("one island, node lost", one_island), ("two islands, island lost", two_islands)]
    for r, name, s in alternating(ARGS.repeats, setups, steps):
        times[name].append(s)
        rows.append([str(r), name, f"{s:.2f}"])
        print(f"round {r}: {name}: a step completed {s:.2f}s after the kill", flush=True)
    print(table(["round", "set-up", "kill -> first step after (s)"], rows))
    print(f"timeouts {ARGS.timeout:.1f}s, snapshots every {ARGS.every} steps; {load_average()}")
    one, two = median(times["one island, node lost"]), median(times["two islands, island lost"])
    print(f"median: one island {one:.2f}s, two islands {two:.2f}s")
    print(f"island_loss_vs_node_loss={two / one:.2f}")


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ARGS = _parse()
    main()
