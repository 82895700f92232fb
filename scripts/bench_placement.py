"""Speed-aware placement: steps/s of a job on devices of unequal speed, uniform vs learned vs oracle.

Cases: N=8 on 2 devices, one at 1/2 speed (arithmetic ceiling of learned over uniform: 8/6 = 1.33), and
N=12 on 3 devices with speeds 1, 1, 1/3 (uniform 4/4/4 waits 12 units, 5/5/2 takes 6: ceiling 2.0).

How a device is made slower (`--slow-by`; nothing tells the scheduler which one is slow in the learned
variant). The job (scripts/_benchjob_placement.py) spends its worker-steps mostly asleep in 1 ms slices,
standing in for device time, so that 2 or 3 agents on this shared 2-core machine do not slow each other
down and the uniform runs measure the imposed speeds, not core contention.
- `wait` (not yet measured): the job's device time per worker-step is PACE / speed of the device its agent runs
  on: a device exactly that much slower at the work, and nothing else (the arithmetic ceilings hold).
- `sigstop` (default): the benchmark duty-cycles the agent process on the slow device with SIGSTOP/SIGCONT (stopped
  a fraction 1 - speed of every PERIOD_S), found by its device in `elasticd status --json` -- what the
  end-to-end test does. The agent loses that fraction of wall time whatever it is doing, also while it
  would only wait for its peers in a collective; once the layout gives it slack, some stops land in that
  slack and cost nothing, so learned/uniform can exceed the ceilings above (a shared or throttled device
  behaves so; a slower GPU does not).

Variants, each on a fresh daemon (embedded scheduler, throwaway state dir, CPU devices):
- uniform: `--no-relayout`, no declared speeds: the layout of before (ceil(N/M) per device);
- learned: the default: it starts uniform, learns the speeds from the agents' timing reports and re-lays
  the job out live; measured once its last re-layout is done (or after LEARN_S without one);
- oracle:  `--device-speed` with the true (nominal) speeds and `--no-relayout`: the placer's layout from
  the start, never changed.
Each run measures steps/s over WINDOW_S of steady training (from rank 0's step count in `status`).
Variants are interleaved, their order rotating by round; figures are medians over rounds. The last line is
`placement_speedup=X.XX`: learned over uniform steps/s for the first case.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

from _benchdaemon import BenchDaemon, wait_for
from _benchjob_common import (
    SCRIPTS,
    BenchError,
    load_average,
    median,
    table,
    tempdir,
)

JOB = SCRIPTS / "_benchjob_placement.py"
CASES = {"8on2": (8, [1.0, 0.5]), "12on3": (12, [1.0, 1.0, 1 / 3])}
VARIANTS = ("uniform", "learned", "oracle")
PERIOD_S = 0.1


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every variant and case (default 3)")
    ap.add_argument("--window", type=float, default=8.0, help="seconds of steady training measured (default 8)")
    ap.add_argument("--learn", type=float, default=40.0, help="learned: wait at most this long for a re-layout")
    ap.add_argument("--pace", type=float, default=0.02, help="seconds of 'device time' per worker-step")
    ap.add_argument("--slow-by", choices=("wait", "sigstop"), default="sigstop",
                    help="impose the slow devices' speeds in the job (wait) or with SIGSTOP/SIGCONT (default sigstop)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"which of {','.join(CASES)} (default both)")
    ap.add_argument("--quick", action="store_true", help="smoke run: one round, first case, short window")
    a = ap.parse_args()
    if a.quick:
        a.rounds, a.window, a.cases = 1, 4.0, "8on2"
    a.cases = [c for c in a.cases.split(",") if c]
    unknown = [c for c in a.cases if c not in CASES]
    if unknown:
        ap.error(f"unknown case(s) {unknown}; known: {','.join(CASES)}")
    return a


class DutyCycle(threading.Thread):
    """Keep process `pid` stopped a fraction `1 - speed` of every PERIOD_S until `stop()`."""

    def __init__(self, pid: int, speed: float) -> None:
        super().__init__(daemon=True)
        self.pid, self.speed = pid, speed
        self._halt = threading.Event()

    def run(self) -> None:
        try:
            while not self._halt.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self._halt.wait(PERIOD_S * (1 - self.speed))
                os.kill(self.pid, signal.SIGCONT)
                self._halt.wait(PERIOD_S * self.speed)
        except ProcessLookupError:
            pass
        finally:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


class Daemon(BenchDaemon):
    """The bench's daemon: fast heartbeats; --spares 0, so an agent's command line names its device (the job
    reads it for `--slow-by wait`); a job that ended is an error."""

    def __init__(self, root: Path, devices: int, *extra: str) -> None:
        super().__init__(root, devices, "--heartbeat", "0.2", "--spares", "0", *extra)

    def job(self, job: str) -> dict[str, Any]:
        info = super().job(job)
        if info["state"] in ("failed", "finished", "stopped"):
            raise BenchError(f"job {job} {info['state']}: {info.get('error')}")
        return info


def one_run(root: Path, case: str, variant: str, a: argparse.Namespace) -> dict[str, Any]:
    workers, speeds = CASES[case]
    extra: list[str] = []
    if variant != "learned":
        extra.append("--no-relayout")
    if variant == "oracle":
        extra += ["--device-speed", ",".join(f"{i}={s:.4f}" for i, s in enumerate(speeds))]
    d = Daemon(root, len(speeds), *extra)
    cycles: list[DutyCycle] = []
    try:
        knobs: dict[str, Any] = {"WORKERS": workers, "PACE_S": a.pace}
        if a.slow_by == "wait":
            knobs["SPEEDS"] = ",".join(f"{i}={s:.6f}" for i, s in enumerate(speeds) if s < 1.0)
        envs = [x for k, v in knobs.items() for x in ("--env", f"ELASTICD_BENCH_{k}={v}")]
        m = str(len(speeds))
        job = d.cli("submit", f"{JOB}:train", "--workers", str(workers), "--min-devices", m, "--max-devices", m,
                    "--snapshot-every", "0", *envs).strip()
        info = wait_for(lambda: (j := d.job(job))["state"] == "running" and j["step"] >= 2 and j, 300, "the job to train", interval=0.2)
        for agent in info["agents"]:
            dev = int(str(agent["device"]).rsplit(":", 1)[-1])
            if speeds[dev] < 1.0 and a.slow_by == "sigstop":
                cycles.append(DutyCycle(agent["pid"], speeds[dev]))
        for c in cycles:
            c.start()
        learned_s = None
        if variant == "learned":
            t0 = time.monotonic()

            def relaid() -> bool:
                j = d.job(job)
                return bool(j["resizing"] is None and any(r.get("blocks_to") and r["outcome"] == "done"
                                                          for r in j["resizes"]))
            try:
                wait_for(relaid, a.learn, "a re-layout", interval=0.2)
                learned_s = time.monotonic() - t0
            except BenchError:
                pass   # measured as it is: the learned variant's failure to move shows in its figure
        time.sleep(1.0)   # past the hand-over's first steps
        s0, t0 = d.job(job)["step"], time.monotonic()
        time.sleep(a.window)
        info = d.job(job)
        s1, t1 = info["step"], time.monotonic()
        lay = info.get("layout") or {}
        return {"steps_per_s": (s1 - s0) / (t1 - t0), "blocks": [x["workers"] for x in lay.get("agents", [])],
                "speeds": [x["speed"] for x in lay.get("agents", [])], "learned_s": learned_s,
                "relayouts": sum(1 for r in info["resizes"] if r.get("blocks_to"))}
    finally:
        for c in cycles:
            c.stop()
        d.close()


def main() -> None:
    a = _parse()
    got: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    with tempdir() as tmp:
        for rnd in range(a.rounds):
            for case in a.cases:
                order = list(VARIANTS[rnd % 3:] + VARIANTS[:rnd % 3])
                for variant in order:
                    r = one_run(Path(tmp) / f"{case}-{variant}-{rnd}", case, variant, a)
                    got[(case, variant)].append(r)
                    print(f"round {rnd + 1}/{a.rounds} {case} {variant}: {r['steps_per_s']:.2f} steps/s blocks "
                          f"{r['blocks']} fitted speeds {r['speeds']}"
                          + (f" re-laid out after {r['learned_s']:.1f}s" if r["learned_s"] is not None else ""),
                          file=sys.stderr, flush=True)
    rows = []
    for case in a.cases:
        base = median([r["steps_per_s"] for r in got[(case, "uniform")]])
        for variant in VARIANTS:
            runs = got[(case, variant)]
            rate = median([r["steps_per_s"] for r in runs])
            rows.append([case, variant, f"{rate:.2f}", f"{rate / base:.2f}", str(runs[-1]["blocks"]),
                         ",".join(f"{s:.2f}" for s in runs[-1]["speeds"])])
    how = "duty-cycled with SIGSTOP/SIGCONT" if a.slow_by == "sigstop" else "waiting pace/speed in the job"
    print(f"speed-aware placement: {a.rounds} round(s), window {a.window:.0f}s, {a.pace * 1000:.0f} ms of device "
          f"time per worker-step at speed 1, slow devices {how}; medians; {load_average()}")
    print(table(["case", "variant", "steps/s", "vs uniform", "blocks (last run)", "fitted speeds (last run)"], rows))
    for case in a.cases:
        base = median([r["steps_per_s"] for r in got[(case, "uniform")]])
        oracle = median([r["steps_per_s"] for r in got[(case, "oracle")]])
        learned = median([r["steps_per_s"] for r in got[(case, "learned")]])
        print(f"placement_oracle_{case}={oracle / base:.2f}")
        print(f"placement_speedup_{case}={learned / base:.2f}")
    first = a.cases[0]
    base = median([r["steps_per_s"] for r in got[(first, "uniform")]])
    learned = median([r["steps_per_s"] for r in got[(first, "learned")]])
    print(f"placement_speedup={learned / base:.2f}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        raise SystemExit(f"benchmark failed: {e}") from None
