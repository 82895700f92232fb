"""A job split over two islands joined by an emulated slow link vs the same job on one island, side by side.

Both run `elasticd run scripts/_benchjob.py:train --devices M` (an MLP on synthetic data, N logical ranks)
on this machine's cores. "one island" is a plain run; "two islands" splits its M agents into two islands
(`ELASTICD_ISLANDS=2`): every all-reduce goes to the island's leader, between the two leaders and back
(agent/comm/islands.py), and the link between the leaders is emulated (`ELASTICD_ISLAND_LINK=MBPS:MS`:
after each exchange a leader waits as long as those bytes would take at that bandwidth and one-way
latency; the bytes themselves go over loopback). This is an emulation: it measures how much of a slow
link the two-level flush hides behind the backward pass (the gradient buckets' sums overlap it), not a
real network. A flat all-reduce over the same link is not emulated (gloo's own algorithms cannot be
slowed from here).

Each round runs both at once, interleaved (scripts/_interleave.py: set up side by side, then turns of
--slice seconds while the other is frozen; only steps wholly inside a job's own turns count); a run's
figure is its median such step, and the ratio is the median over rounds.

The last line is `two_islands_vs_one=X.XX`: steps a second on two islands / on one (1.00: the link costs
nothing; Pathways' two islands of 512 chips over a data-centre network: 0.972).
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from _benchjob import CLASSES, IN_DIM
from _benchjob_common import (
    JOB,
    BenchError,
    elasticd_cmd,
    job_env,
    load_average,
    median,
    out_file,
    table,
    tempdir,
)
from _interleave import Job, compare


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=4, help="M agents (default 4: two islands of 2)")
    ap.add_argument("--workers", type=int, default=8, help="N logical ranks (default 8)")
    ap.add_argument("--width", type=int, default=512, help="MLP hidden width (default 512)")
    ap.add_argument("--link", default="1000:1",
                    help="the emulated link, MBPS:MS (default 1000:1: 1 Gbit/s, 1 ms one way)")
    ap.add_argument("--steps", type=int, default=150, help="steps per run, warm-up included (default 150)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed first steps of each run (default 5)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds (default 3)")
    ap.add_argument("--slice", type=float, default=1.5, help="seconds each run gets the machine for (default 1.5)")
    ap.add_argument("--quick", action="store_true", help="smoke run: N=4, a small model, one round")
    a = ap.parse_args()
    if a.quick:
        a.workers, a.devices, a.width, a.steps, a.warmup, a.repeats, a.slice = 4, 4, 64, 200, 2, 1, 0.2
    if a.devices < 2:
        ap.error("--devices must be at least 2 (two islands)")
    return a


VARIANTS = {"one island": {}, "two islands": {"ELASTICD_ISLANDS": "2"}}


def main() -> None:
    a = _parse()
    times: dict[str, list[float]] = defaultdict(list)
    ratios: list[float] = []
    knobs = {"workers": a.workers, "steps": a.steps, "width": a.width}
    w = a.width   # _benchjob.make_model's MLP: IN_DIM -> w -> w -> w -> CLASSES, with biases
    params = (IN_DIM + 1) * w + 2 * (w + 1) * w + (w + 1) * CLASSES
    with tempdir() as tmp:
        for rnd in range(a.repeats):
            names = list(VARIANTS)[rnd % 2:] + list(VARIANTS)[:rnd % 2]
            jobs = []
            for name in names:
                path = out_file(tmp, f"{name.replace(' ', '_')}{rnd}")
                env = {**job_env(**knobs, out=path), **VARIANTS[name]}
                if VARIANTS[name]:
                    env["ELASTICD_ISLAND_LINK"] = a.link
                cmd = elasticd_cmd("run", f"{JOB}:train", "--workers", str(a.workers), "--devices", str(a.devices))
                jobs.append(Job(name, cmd, env, path))
            got = compare(jobs, a.warmup, a.slice)
            for name in VARIANTS:
                times[name].append(got[name])
            ratios.append(got["one island"] / got["two islands"])
    rows = [[name, f"{median(times[name]) * 1e3:.2f}", f"{1 / median(times[name]):.1f}"] for name in VARIANTS]
    print(f"N={a.workers} on M={a.devices} devices, MLP width {a.width} ({params * 4 / 2**20:.2f} MiB of "
          f"gradients a step), emulated link {a.link} (Mbit/s:ms); {a.repeats} round(s); {load_average()}")
    print(table(["variant", "ms/step", "steps/s"], rows))
    print("per round: " + " ".join(f"{r:.3f}" for r in ratios))
    print(f"two_islands_vs_one={median(ratios):.2f}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        raise SystemExit(f"benchmark failed: {e}") from None
