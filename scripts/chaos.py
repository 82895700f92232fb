"""Chaos: random faults at random moments against a running deterministic job; it must end bitwise undisturbed.

Each trial runs scripts/_benchjob.py (`train_det`, N=8 logical workers, deterministic mode) under
`elasticd run --devices 2 --snapshot-every K`, and at seeded random moments hits it with faults drawn from:

- kill:   SIGKILL of a random agent (an OOM kill, a segfault in native code);
- term:   SIGTERM of a random agent (someone's `kill`, a container runtime);
- stop:   SIGSTOP of a random agent, never continued (a hung process): the watchdog fences it after
          `--stuck-after 2` and the job recovers;
- double: SIGKILL of one agent, then of another while the job is still recovering.

A trial passes when the run exits 0 with final parameters bitwise equal to an undisturbed run's (the job's
digest) and the run recorded one recovery per fault that landed (a fault that came after the last step
finds nothing to recover: counted as passed, marked "late"). Printed per trial: the faults, recovery
seconds and steps redone. Bounded by --trials and --budget seconds. The last line is `recovered=K/N`.
`--quick` (the test suite's) runs two short trials, a stop and a double kill, at seeded moments.

`elasticd run` is the supervisor here (one machine, no daemon); tests/elasticd/daemon/test_recovery_daemon.py covers
the daemon's and scheduler's side (a killed agent, a lost node).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import subprocess
import sys
import time

import psutil
from _benchjob_common import (
    JOB,
    REPO,
    BenchError,
    elasticd_cmd,
    job_env,
    launcher_agents,
    out_file,
    own_processes,
    read_json,
    tempdir,
)

WORKERS, DEVICES = 8, 2
FAULTS = ["kill", "term", "stop", "double"]
QUICK_FAULTS = ["stop", "double"]   # what the others add is covered by tests/elasticd/test_run_recovery.py
STUCK_AFTER = "2"


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=10, help="number of trials (default 10)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the faults and their moments (default 0)")
    ap.add_argument("--steps", type=int, default=60, help="steps of the job (default 60)")
    ap.add_argument("--every", type=int, default=5, help="snapshot interval in steps (default 5)")
    ap.add_argument("--width", type=int, default=256, help="MLP hidden width (default 256)")
    ap.add_argument("--budget", type=float, default=1800.0, help="stop starting trials after this many seconds")
    ap.add_argument("--quick", action="store_true", help="two short trials, a stop and a double kill (what the test "
                                                          "suite runs)")
    a = ap.parse_args()
    if a.quick:
        a.trials, a.steps, a.every, a.width = 2, 24, 4, 64
    return a


def _agents(launcher: subprocess.Popen[bytes]) -> list[psutil.Process]:
    return launcher_agents(launcher.pid)


def _hit(proc: subprocess.Popen[bytes], sig: int, rng: random.Random) -> bool:
    agents = _agents(proc)
    if not agents:
        return False
    try:
        rng.choice(agents).send_signal(sig)
    except psutil.NoSuchProcess:
        return False
    return True


def _wait_for_agents(proc: subprocess.Popen[bytes]) -> float:
    """When the run's first agent exists (monotonic): faults are timed from there, as the training is, not
    from the launcher's start (the fork server's torch import would eat the moment)."""
    deadline = time.monotonic() + 120
    while not _agents(proc) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return time.monotonic()


def _training_seconds(a: argparse.Namespace, out: str) -> float:
    """The undisturbed run, timed as a trial's faults are: from its first agent to its end."""
    proc = subprocess.Popen(elasticd_cmd("run", f"{JOB}:train_det", "--workers", str(WORKERS), "--devices",
                                         str(DEVICES), "--snapshot-every", "0"),
                            env=own_processes(job_env(workers=WORKERS, steps=a.steps, width=a.width, out=out)), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    started = _wait_for_agents(proc)
    _, err = proc.communicate(timeout=900)
    if proc.returncode != 0:
        raise BenchError(f"the undisturbed run failed:\n{err.decode()[-2000:]}")
    return time.monotonic() - started


def trial(a: argparse.Namespace, tmp: str, rng: random.Random, duration: float, want: str, n: int) -> dict:
    kind = QUICK_FAULTS[n % len(QUICK_FAULTS)] if a.quick else rng.choice(FAULTS)
    at = rng.uniform(0.1, 0.9) * duration
    summary, out = out_file(tmp, f"summary{n}"), out_file(tmp, f"out{n}")
    proc = subprocess.Popen(elasticd_cmd("run", f"{JOB}:train_det", "--workers", str(WORKERS), "--devices",
                                         str(DEVICES), "--snapshot-every", str(a.every), "--max-restarts", "5",
                                         "--stuck-after", STUCK_AFTER, "--summary", summary),
                            env=own_processes(job_env(workers=WORKERS, steps=a.steps, width=a.width, out=out)), cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    landed = 0
    try:
        started = _wait_for_agents(proc)
        while proc.poll() is None and time.monotonic() - started < at:
            time.sleep(0.01)
        if proc.poll() is None:
            sig = {"term": signal.SIGTERM, "stop": signal.SIGSTOP}.get(kind, signal.SIGKILL)
            landed += _hit(proc, sig, rng)
            if kind == "double":
                # Again once the restarted agents exist (the job is recovering), at a random moment of that.
                while proc.poll() is None and len(_agents(proc)) >= DEVICES:
                    time.sleep(0.005)
                grace = time.monotonic() + rng.uniform(0.5, 3.0)
                while proc.poll() is None and time.monotonic() < grace:
                    time.sleep(0.01)
                if proc.poll() is None:
                    landed += _hit(proc, signal.SIGKILL, rng)
        _, err = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    result = {"trial": n, "fault": kind, "at_s": round(at, 2), "exit": proc.returncode, "landed": landed}
    if proc.returncode != 0:
        return {**result, "ok": False, "why": err.decode()[-1500:]}
    recs = read_json(summary)["recoveries"]
    got = read_json(out)["digest"]
    result.update(recoveries=len(recs), seconds=[r.get("seconds") for r in recs],
                  redone=[r.get("steps_redone") for r in recs], causes=[r.get("cause") for r in recs])
    # A kill that reached an agent after its last step (or between exit and reaping) may need no recovery.
    result["ok"] = got == want and len(recs) <= landed
    if not result["ok"]:
        result["why"] = "final parameters differ from the undisturbed run" if got != want else \
            f"{len(recs)} recoveries for {landed} faults"
    elif len(recs) < landed:
        result["late"] = True
    return result


def main() -> None:
    a = _parse()
    rng = random.Random(a.seed)
    began = time.monotonic()
    with tempdir() as tmp:
        ref = out_file(tmp, "ref")
        duration = _training_seconds(a, ref)
        want = read_json(ref)["digest"]
        results = []
        for n in range(a.trials):
            if time.monotonic() - began > a.budget:
                print(f"budget of {a.budget:.0f}s spent after {n} trial(s)", file=sys.stderr)
                break
            r = trial(a, tmp, rng, duration, want, n)
            results.append(r)
            print(json.dumps(r), flush=True)
    ok = sum(r["ok"] for r in results)
    late = sum(bool(r.get("late")) for r in results)
    print(f"late={late} (faults that found the job finished: nothing to recover)")
    print(f"recovered={ok}/{len(results)}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        raise SystemExit(f"chaos failed: {e}") from None
