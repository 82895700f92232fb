"""Recovery after a killed agent, beside a torchrun-style restart; and what periodic snapshots cost.

The job is scripts/_benchjob.py (an MLP on synthetic data, N=8 logical workers, SGD with momentum) under
`elasticd run` on 2 CPU devices.

elasticd recovery: the job runs with `--snapshot-every K` (steps) and a snapshot directory the benchmark
watches; once the snapshot of step K is complete on disk (tmpfs), agent 1 is SIGKILLed. The run's node
notices, stops the other agent, starts two fresh agents that restore the snapshot and go on. The figure
is wall time from the kill to the first step completed after it (the run's summary stamps it), with
how many steps were redone.

torchrun-style restart (as in bench_resize.py): the same job saves a checkpoint to disk after step K;
once it is there every process is killed and a fresh run loads it. Wall time from the kill to its first
step. (torchrun itself adds its failure detector and rendezvous on top; elasticd's recovery needs no
checkpoint code in the script, and loses at most K steps instead of everything since the last one the
user wrote.)

Snapshot cost: the same job with snapshots off, every S steps, and at the default interval, interleaved
round by round; the cost is the difference in mean step time (all steps after warm-up, not a median,
which would hide the steps that take a snapshot). The per-snapshot cost times the default interval's
rate gives what the default costs on a long run; a short run at the default may take no snapshot at all.

Last line: `recovery_seconds=X.XX` (median, kill -> first step after recovery).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import defaultdict

import psutil
from _benchjob_common import (
    JOB,
    REPO,
    BenchError,
    elasticd_cmd,
    job_env,
    launcher_agents,
    load_average,
    median,
    out_file,
    own_processes,
    rank_of,
    read_json,
    run,
    table,
    tempdir,
)
from bench_resize import restart

from elasticd.core.cadence import DEFAULT_SNAPSHOT_EVERY, Every

WORKERS, DEVICES = 8, 2


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=512, help="MLP hidden width (default 512)")
    ap.add_argument("--at", type=int, default=10, help="K: snapshot / checkpoint after step K (default 10)")
    ap.add_argument("--every", type=int, default=5, help="S: snapshot interval in steps for the cost (default 5)")
    ap.add_argument("--steps", type=int, default=60, help="steps of each cost run (default 60)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every variant (default 3)")
    ap.add_argument("--quick", action="store_true", help="smoke run: one round, a small model, short runs")
    a = ap.parse_args()
    if a.quick:
        a.width, a.at, a.every, a.steps, a.repeats = 64, 4, 4, 16, 1
    a.device_type, a.device_args = "cpu", ("--device-type", "cpu")   # what bench_resize.restart reads
    return a


def _agent(launcher: subprocess.Popen[bytes], rank: int) -> psutil.Process:
    for c in launcher_agents(launcher.pid):
        if rank_of(c) == rank:
            return c
    raise BenchError(f"no agent of rank {rank}")


def recovery(a: argparse.Namespace, tmp: str) -> dict[str, float]:
    """Kill agent 1 once the snapshot of step K is complete; seconds to the first step after it."""
    snaps = os.path.join(tmp, "snaps")
    summary = out_file(tmp, "recovery-summary")
    done = os.path.join(snaps, f"s{a.at}")
    proc = subprocess.Popen(elasticd_cmd("run", f"{JOB}:train", "--workers", str(WORKERS), "--devices", str(DEVICES),
                                         "--snapshot-every", str(a.at), "--snapshot-dir", snaps, "--summary", summary),
                            env=own_processes(job_env(workers=WORKERS, steps=a.at * 4, width=a.width,
                                                      out=out_file(tmp, "rec"))),
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 600
        while not (os.path.isdir(done) and len([n for n in os.listdir(done) if n.endswith(".pt")]) == WORKERS + 1):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise BenchError(f"no complete snapshot of step {a.at}: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
            time.sleep(0.005)
        _agent(proc, 1).kill()
        killed = time.time()
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise BenchError(f"the recovered run exited {proc.returncode}: {err.decode()[-3000:]}")
    recs = read_json(summary)["recoveries"]
    if len(recs) != 1:
        raise BenchError(f"expected one recovery, got {recs}")
    # The record's clock is the wall clock: its failure time plus its seconds is the first step after it.
    return {"seconds": recs[0]["at"] + recs[0]["seconds"] - killed, "redone": recs[0]["steps_redone"]}


def mean_step(a: argparse.Namespace, tmp: str, every: str) -> float:
    out = out_file(tmp, f"cost-{every}")
    run(elasticd_cmd("run", f"{JOB}:train", "--workers", str(WORKERS), "--devices", str(DEVICES),
                     "--snapshot-every", every),
        job_env(workers=WORKERS, steps=a.steps, width=a.width, out=out), timeout=900)
    stamps = read_json(out)["stamps"][3:]   # warm-up: the first steps build buffers and caches
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


def main() -> None:
    a = _parse()
    figures: dict[str, list[float]] = defaultdict(list)
    variants = ["recovery", "restart", "off", "every", "default"]
    with tempdir() as tmp:
        for rnd in range(a.repeats):
            for v in (variants if rnd % 2 == 0 else variants[::-1]):   # alternate which runs first
                if v == "recovery":
                    f = recovery(a, tmp)
                    figures["recovery seconds"].append(f["seconds"])
                    figures["recovery redone"].append(f["redone"])
                elif v == "restart":
                    figures["restart seconds"].append(restart(a, tmp, DEVICES, DEVICES)["seconds"])
                else:
                    every = {"off": "0", "every": str(a.every), "default": DEFAULT_SNAPSHOT_EVERY}[v]
                    figures[f"step {v}"].append(mean_step(a, tmp, every))
            print(f"round {rnd + 1}/{a.repeats}: " + "  ".join(f"{k}={v[-1]:.4g}" for k, v in figures.items()),
                  file=sys.stderr, flush=True)
    m = {k: median(v) for k, v in figures.items()}
    per_snapshot = max(0.0, m["step every"] - m["step off"]) * a.every   # seconds of training lost per snapshot
    default_s = Every.parse(DEFAULT_SNAPSHOT_EVERY).seconds
    print(f"N={WORKERS} logical workers on {DEVICES} CPU devices, MLP width {a.width}, {a.repeats} round(s), "
          f"medians; {load_average()}")
    print(table(["after SIGKILL of one agent", "kill -> first step (s)", "steps redone"],
                [["elasticd recovery from its periodic snapshot", f"{m['recovery seconds']:.2f}",
                  f"{m['recovery redone']:.0f}"],
                 ["torchrun-style restart from a disk checkpoint", f"{m['restart seconds']:.2f}",
                  "since the user's last checkpoint"]]))
    print(table(["periodic snapshots", "mean step (ms)", "vs off"],
                [["off", f"{m['step off'] * 1e3:.2f}", "1.000"],
                 [f"every {a.every} steps", f"{m['step every'] * 1e3:.2f}", f"{m['step every'] / m['step off']:.3f}"],
                 [f"default ({DEFAULT_SNAPSHOT_EVERY}) on this {a.steps}-step run", f"{m['step default'] * 1e3:.2f}",
                  f"{m['step default'] / m['step off']:.3f}"]]))
    if default_s:
        print(f"one snapshot costs {per_snapshot * 1e3:.1f} ms of training; at the default interval that is "
              f"{100 * per_snapshot / default_s:.2f}% of a long run's time")
    print(f"recovery_seconds={m['recovery seconds']:.2f}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        raise SystemExit(f"benchmark failed: {e}") from None
