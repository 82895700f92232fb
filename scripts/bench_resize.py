"""Live resize vs a torchrun-style restart: time from the scale request to the first step at the new size.

The job (scripts/_benchjob.py with N=4: an MLP on synthetic data, SGD with momentum) runs on CPU.

elasticd, live: `elasticd run --devices 4 --scale-at K:2,2K:4 --summary FILE` shrinks 4 -> 2 after step K
and grows back 2 -> 4 after step 2K. The run's summary records, per resize, `seconds` (request -> first
completed step at the new size) and `stall` (last step at the old size -> first step at the new size).
The agents that leave in the shrink stay warm for the grow (the node keeps them as standby agents).

torchrun-style restart, emulated on the same machine: a run of the same job on the old M saves a
checkpoint (`torch.save` of model + optimizer) after step K; once the file is on disk every process of
the job is killed (SIGKILL to its process group: the fastest possible teardown), and a fresh
`elasticd run --devices M'` of the same script loads the checkpoint and runs the next step. The figure
is wall time from the kill to that step's completion: teardown, process start, imports, rendezvous,
checkpoint load, first step. (A real torchrun adds its rendezvous timeouts and a failure detector on top.)

Variants alternate round by round; figures are medians over rounds. The last line is
`resize_seconds=X.XX`: the worse of the shrink and grow medians of `seconds` (goal < 5 s, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import signal
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
    load_average,
    median,
    out_file,
    own_processes,
    process_tree,
    read_json,
    run,
    table,
    tempdir,
)

WORKERS = 4


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=512, help="MLP hidden width (default 512)")
    ap.add_argument("--at", type=int, default=10, help="K: shrink after step K, grow after step 2K (default 10)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every variant (default 3)")
    ap.add_argument("--device-type", choices=["cpu", "cuda"], default="cpu",
                    help="agents' devices (cuda with fewer than 4 GPUs: agents share them over the gloo test "
                         "backend, ELASTICD_DEVICE_BACKEND=gloo, which NCCL figures will not match)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: one round, a small model, the restart baseline for the shrink only")
    a = ap.parse_args()
    if a.quick:
        a.width, a.at, a.repeats = 64, 4, 1
    a.device_args = ("--device-type", a.device_type)
    if a.device_type == "cuda":
        import torch  # only for a GPU run: the CPU benchmark never initialises CUDA here

        if torch.cuda.device_count() < 4:
            os.environ["ELASTICD_DEVICE_BACKEND"] = "gloo"  # inherited by every job_env()
    return a


def live(a: argparse.Namespace, tmp: str) -> dict[str, dict[str, float]]:
    """One `elasticd run` that shrinks 4 -> 2 and grows 2 -> 4; the run's figures per direction."""
    summary = out_file(tmp, "summary")
    steps = 3 * a.at + 5  # a few steps after the grow, so its first step at 4 devices surely completes
    run(elasticd_cmd("run", f"{JOB}:train", "--workers", str(WORKERS), "--devices", "4", *a.device_args,
                     "--scale-at", f"{a.at}:2,{2 * a.at}:4", "--summary", summary),
        job_env(workers=WORKERS, steps=steps, width=a.width), timeout=900)
    got = read_json(summary)
    out = {}
    for r in got["resizes"]:
        if r["seconds"] is None:
            raise BenchError(f"a resize never completed a step at its new size: {got}")
        out["shrink" if r["to"] < r["from"] else "grow"] = {"seconds": r["seconds"], "stall": r["stall"]}
    if set(out) != {"shrink", "grow"}:
        raise BenchError(f"expected one shrink and one grow in the summary, got {got}")
    return out


def _kill_job(proc: subprocess.Popen[bytes]) -> None:
    """Kill the run and every agent (its process group), and wait until none of them runs."""
    family = process_tree(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while any(_running(p) for p in family):
        if time.monotonic() > deadline:
            raise BenchError("agents still running 30 s after SIGKILL")
        time.sleep(0.005)


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE  # a zombie holds no CPU, memory or sockets any more
    except psutil.NoSuchProcess:
        return False


def restart(a: argparse.Namespace, tmp: str, old: int, new: int) -> dict[str, float]:
    """Seconds from killing a job of `old` agents to the first step of a fresh job of `new` agents."""
    ckpt = os.path.join(tmp, "ckpt.pt")
    if os.path.exists(ckpt):
        os.unlink(ckpt)
    first = out_file(tmp, "first")
    # The first job trains "forever": it is killed once its checkpoint is on disk, like a job that loses a node.
    env = own_processes(job_env(workers=WORKERS, steps=10**6, width=a.width, save_at=a.at, ckpt=ckpt, out=first))
    proc = subprocess.Popen(elasticd_cmd("run", f"{JOB}:train", "--workers", str(WORKERS), "--devices", str(old),
                                         *a.device_args),
                            env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # its own process group: one killpg reaches every agent
    try:
        deadline = time.monotonic() + 600
        while not os.path.exists(ckpt):
            if proc.poll() is not None:
                raise BenchError(f"the checkpointing run exited with {proc.returncode} before saving")
            if time.monotonic() > deadline:
                raise BenchError("no checkpoint after 600 s")
            time.sleep(0.005)
        killed = time.time()
        _kill_job(proc)
        gone = time.time()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    resumed = out_file(tmp, "resumed")
    run(elasticd_cmd("run", f"{JOB}:train", "--workers", str(WORKERS), "--devices", str(new), *a.device_args),
        job_env(workers=WORKERS, steps=a.at + 2, width=a.width, ckpt=ckpt, resume=1, out=resumed), timeout=900)
    done = read_json(resumed)["first_step_done_wall"]
    return {"seconds": done - killed, "teardown": gone - killed}


def main() -> None:
    a = _parse()
    restarts = [("shrink", 4, 2)] if a.quick else [("shrink", 4, 2), ("grow", 2, 4)]
    figures: dict[str, list[float]] = defaultdict(list)
    with tempdir() as tmp:
        for rnd in range(a.repeats):
            steps: list[tuple[str, int, int] | None] = [None, *restarts]
            if rnd % 2:
                steps.reverse()  # alternate which variant runs first
            for step in steps:
                if step is None:
                    for direction, f in live(a, tmp).items():
                        figures[f"live {direction} seconds"].append(f["seconds"])
                        figures[f"live {direction} stall"].append(f["stall"])
                else:
                    direction, old, new = step
                    f = restart(a, tmp, old, new)
                    figures[f"restart {direction} seconds"].append(f["seconds"])
                    figures[f"restart {direction} teardown"].append(f["teardown"])
            print(f"round {rnd + 1}/{a.repeats}: " + "  ".join(f"{k}={v[-1]:.2f}" for k, v in figures.items()),
                  file=sys.stderr, flush=True)

    def fig(key: str) -> str:
        return f"{median(figures[key]):.2f}" if figures.get(key) else "-"

    rows = []
    for direction, old, new in (("shrink", 4, 2), ("grow", 2, 4)):
        live_s, restart_s = figures[f"live {direction} seconds"], figures.get(f"restart {direction} seconds")
        speedup = f"{median(restart_s) / median(live_s):.1f}x" if restart_s else "-"
        rows.append([f"{direction} {old} -> {new}", fig(f"live {direction} seconds"), fig(f"live {direction} stall"),
                     fig(f"restart {direction} seconds"), fig(f"restart {direction} teardown"), speedup])
    shared = " (agents sharing GPUs over gloo)" if os.environ.get("ELASTICD_DEVICE_BACKEND") == "gloo" else ""
    print(f"N={WORKERS} logical workers on {a.device_type.upper()}{shared}, MLP width {a.width}, resize after step {a.at} (shrink) and "
          f"{2 * a.at} (grow), {a.repeats} round(s), medians in seconds; {load_average()}")
    print(table(["resize", "elasticd: request->step", "stall", "restart: kill->step", "of which teardown",
                 "restart/elasticd"], rows))
    worst = max(median(figures["live shrink seconds"]), median(figures["live grow seconds"]))
    print(f"resize_seconds={worst:.2f}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        raise SystemExit(f"benchmark failed: {e}") from None
