"""One resize schedule, two lifecycles: `elasticd run --scale-at` beside a node daemon's `submit --scale-at`.

The job (scripts/_benchjob.py, N=4: an MLP on synthetic data, SGD with momentum) runs on 4 CPU devices
and is resized 4 -> 2 -> 4 -> 2 -> 4 after steps K, 2K, 3K and 4K, once under `elasticd run` and once
submitted to a fresh node daemon (throwaway state dir, embedded scheduler, no TCP, `--pin-cpus`, as
`elasticd run` pins its CPU agents). What a resize costs is read from the job's own step stamps, the same
way for both: the step the agents held after lasted this much longer than the median step before it
(the pause: vote, hand-over, the new group, its first step's set-up). The lifecycles' own `seconds`
(request -> first step at the new size) are shown too.

`elasticd run` holds the same node and scheduler in its own process (elasticd/local_node.py), so the two
differ only in that process boundary, the daemon's 1 s heartbeat (the run's node beats every
`local_node.HEARTBEAT_S`, 0.25 s), and what else the daemon serves: the figure says what a standalone daemon
adds to a scheduled resize. Rounds alternate which lifecycle runs first; figures are medians over rounds.
The last line is `daemon_vs_run_pause=X.XX`: the daemon's median pause over `elasticd run`'s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from _benchdaemon import BenchDaemon, wait_for
from _benchjob_common import (
    JOB,
    BenchError,
    elasticd_cmd,
    job_env,
    load_average,
    median,
    out_file,
    read_json,
    run,
    step_seconds,
    table,
    tempdir,
)

from elasticd.core.lifecycle import JOB_ENDED

WORKERS = 4
SIZES = (2, 4, 2, 4)   # after steps K, 2K, 3K, 4K


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=512, help="MLP hidden width (default 512)")
    ap.add_argument("--at", type=int, default=10, help="K: resize after steps K, 2K, 3K and 4K (default 10)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of both lifecycles (default 3)")
    ap.add_argument("--quick", action="store_true", help="smoke run: one round, a small model, K=4")
    a = ap.parse_args()
    if a.quick:
        a.width, a.at, a.repeats = 64, 4, 1
    return a


def pauses(stamps: list[float], at: int) -> list[float]:
    """Per resize, how much longer the held step took than the median step of its segment (after the
    segment's first step, which may still be warming up)."""
    out, start = [], 0
    for k in range(1, len(SIZES) + 1):
        held = k * at
        out.append(stamps[held + 1] - stamps[held] - step_seconds(stamps[start:held + 1], warmup=1))
        start = held + 1
    return out


def schedule(at: int) -> str:
    return ",".join(f"{(i + 1) * at}:{m}" for i, m in enumerate(SIZES))


def in_run(a: argparse.Namespace, tmp: str, out: str) -> tuple[list[float], list[float]]:
    summary = out_file(tmp, "summary")
    run(elasticd_cmd("run", f"{JOB}:train", "--workers", str(WORKERS), "--devices", "4", "--scale-at",
                     schedule(a.at), "--summary", summary),
        job_env(workers=WORKERS, steps=(len(SIZES) + 1) * a.at + 3, width=a.width, out=out), timeout=900)
    recorded = [r["seconds"] for r in read_json(summary)["resizes"]]
    return pauses(read_json(out)["stamps"], a.at), recorded


def daemon(a: argparse.Namespace, tmp: str, out: str) -> tuple[list[float], list[float]]:
    env = job_env(workers=WORKERS, steps=(len(SIZES) + 1) * a.at + 3, width=a.width, out=out)
    d = BenchDaemon(Path(tmp) / "sd", 4, "--pin-cpus", env=env)
    try:
        job = d.cli("submit", f"{JOB}:train", "--workers", str(WORKERS), "--min-devices", "4", "--max-devices", "4",
                    "--scale-at", schedule(a.at)).strip()
        info = wait_for(lambda: (j := d.job(job))["state"] in JOB_ENDED and j, 600,
                        "the job to end")
    finally:
        d.close()
    if info["state"] != "finished" or [r["outcome"] for r in info["resizes"]] != ["done"] * len(SIZES):
        raise BenchError(f"the daemon's job ended {info['state']} with resizes {info['resizes']}")
    return pauses(read_json(out)["stamps"], a.at), [r["seconds"] for r in info["resizes"]]


def main() -> None:
    a = _parse()
    figures: dict[str, list[float]] = defaultdict(list)
    # A daemon running as root runs the job as another user (elasticd-job): the job's stamps go to a
    # directory anyone may write, outside the state dir (whose parents must not be).
    shared = tempfile.mkdtemp(prefix="elasticd-bench-out-")
    os.chmod(shared, 0o777)
    try:
        with tempdir() as tmp:
            for rnd in range(a.repeats):
                order = [("run", in_run), ("daemon", daemon)]
                if rnd % 2:
                    order.reverse()
                for name, variant in order:
                    out = os.path.join(shared, f"{name}-{rnd}.json")
                    got, recorded = variant(a, tempfile.mkdtemp(dir=tmp), out)
                    for i, (pause, seconds) in enumerate(zip(got, recorded, strict=True)):
                        direction = "shrink" if SIZES[i] < (SIZES[i - 1] if i else 4) else "grow"
                        figures[f"{name} {direction} pause"].append(pause)
                        figures[f"{name} {direction} seconds"].append(seconds)
                    print(f"round {rnd + 1}/{a.repeats} {name}: pauses " + " ".join(f"{x:.3f}" for x in got)
                          + "  recorded " + " ".join(f"{x:.3f}" for x in recorded), file=sys.stderr, flush=True)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    rows = []
    for name in ("run", "daemon"):
        rows.append([f"elasticd {name}" if name == "run" else "daemon (submit)",
                     *(f"{median(figures[f'{name} {d} {k}']):.3f}" for d in ("shrink", "grow")
                       for k in ("pause", "seconds"))])
    print(f"N={WORKERS} on 4 CPU devices, MLP width {a.width}, resized 4->2->4->2->4 after steps "
          f"{schedule(a.at)}, {a.repeats} round(s), medians in seconds; {load_average()}")
    print(table(["lifecycle", "shrink pause", "shrink recorded", "grow pause", "grow recorded"], rows))
    ratio = median(figures["daemon shrink pause"] + figures["daemon grow pause"]) / median(
        figures["run shrink pause"] + figures["run grow pause"])
    print(f"daemon_vs_run_pause={ratio:.2f}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        raise SystemExit(f"benchmark failed: {e}") from None
