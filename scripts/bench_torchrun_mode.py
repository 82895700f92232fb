"""torchrun mode: an unchanged torchrun script under torchrun with N processes vs `elasticd run` on M devices.

One run, side by side, on the same tutorial-style script (scripts/_bench_torchrun_job.py: an MLP wrapped
in DistributedDataParallel, N=4 ranks x 32 samples, SGD with momentum):

  (a) torchrun   `python -m torch.distributed.run --standalone --nproc_per_node 4`: 4 gloo processes
                 of torch's own DDP (torchrun sets OMP_NUM_THREADS=1 for each, as a user gets it);
  (b) M=1        `elasticd run --workers 4 --devices 1`: the 4 ranks time-sliced in one agent process;
  (c) M=2        `elasticd run --workers 4 --devices 2`: two agents sharing the machine's cores.

Every variant gets all of this machine's cores with each tool's defaults. Logical rank 0 stamps every
step start, so start-up, imports and rendezvous never count; the first --warmup steps are dropped and a
run's figure is its median step. The machine is shared and noisy, so the variants are interleaved
(--repeats rounds, the order alternating) and each figure is the median over rounds. The parameter
checksums must agree (same math, up to the order of fp32 sums).

Also timed, once per round: a resize of the torchrun-mode job (`--scale-at` from 2 devices to 1), which
stops every agent and starts the new size (the script would then load its own checkpoint; this one has
none and starts over): seconds from the request to the first step at the new size, as `--summary` reports.

The last line is `torchrun_mode_vs_torchrun=X.XX`: steps/s of (c) over steps/s of (a), elasticd on 2
devices against torchrun with 4 processes on the same cores (goal >= 1: at least as fast, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import sys

from _benchjob_common import (
    REPO,
    BenchError,
    elasticd_cmd,
    load_average,
    median,
    out_file,
    read_json,
    run,
    step_seconds,
    table,
    tempdir,
)

JOB = REPO / "scripts" / "_bench_torchrun_job.py"
WORKERS = 4


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch (default 32)")
    ap.add_argument("--width", type=int, default=512, help="MLP hidden width (default 512)")
    ap.add_argument("--steps", type=int, default=40, help="steps per run, warm-up included (default 40)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed first steps of each run (default 5)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the three variants (default 3)")
    ap.add_argument("--quick", action="store_true", help="one short round (a smoke test, not a figure)")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.warmup, a.repeats = 12, 2, 1
    return a


def command(variant: str, a: argparse.Namespace, out: str) -> list[str]:
    job = [str(JOB), "--out", out, "--steps", str(a.steps), "--width", str(a.width), "--batch", str(a.batch)]
    if variant == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(WORKERS), *job]
    devices = variant.removeprefix("M=")
    return elasticd_cmd("run", "--workers", str(WORKERS), "--devices", devices, *job)


def restart_seconds(a: argparse.Namespace, tmp: str) -> float:
    out, summary = out_file(tmp, "restart"), out_file(tmp, "summary")
    cmd = command("M=2", a, out)
    cmd[cmd.index("run") + 1:cmd.index("run") + 1] = ["--scale-at", f"{a.warmup}:1", "--summary", summary]
    run(cmd, dict(os.environ), timeout=600)
    resizes = read_json(summary)["resizes"]
    if len(resizes) != 1 or resizes[0]["outcome"] != "restarted":
        raise BenchError(f"expected one restart, got {resizes}")
    return float(resizes[0]["seconds"])


def main() -> None:
    a = _parse()
    variants = ["torchrun", "M=1", "M=2"]
    seconds: dict[str, list[float]] = {v: [] for v in variants}
    checksums: dict[str, float] = {}
    restarts: list[float] = []
    with tempdir() as tmp:
        for rnd in range(a.repeats):
            for variant in (variants if rnd % 2 == 0 else variants[::-1]):
                out = out_file(tmp, variant.replace("=", ""))
                run(command(variant, a, out), dict(os.environ), timeout=600)
                result = read_json(out)
                seconds[variant].append(step_seconds(result["stamps"], a.warmup))
                checksums[variant] = result["checksum"]
            restarts.append(restart_seconds(a, tmp))
            print(f"round {rnd + 1}/{a.repeats}: restart {restarts[-1]:.2f}s  " + "  ".join(f"{v} {seconds[v][-1] * 1000:.1f} ms/step"
                                                              for v in variants), file=sys.stderr, flush=True)
    ref = checksums["torchrun"]
    for variant, c in checksums.items():
        if abs(c - ref) > 1e-4 * max(1.0, abs(ref)):
            raise BenchError(f"{variant} computed something else: parameter checksum {c!r} vs torchrun's {ref!r}")
    per_step = {v: median(s) for v, s in seconds.items()}
    rows = [[v, f"{per_step[v] * 1000:.1f}", f"{1 / per_step[v]:.2f}", f"{per_step['torchrun'] / per_step[v]:.2f}"]
            for v in variants]
    print(f"N={WORKERS} tutorial-style DDP script, MLP width {a.width}, batch {a.batch}/rank, {a.steps} steps "
          f"({a.warmup} warm-up), median of {a.repeats} round(s); {load_average()}")
    print(table(["variant", "ms/step", "steps/s", "vs torchrun (steps/s)"], rows))
    print(f"restart of the torchrun-mode job 2 -> 1 device (request -> first step at the new size): "
          f"{median(restarts):.2f}s")
    print(f"torchrun_mode_vs_torchrun={per_step['torchrun'] / per_step['M=2']:.2f}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        print(f"benchmark failed: {e}", file=sys.stderr)
        sys.exit(1)
