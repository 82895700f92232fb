"""Trace simulation of the island policy: mean job completion time, today's uniform placement vs speed-aware.

Pure arithmetic (no processes, no timing): the same synthetic traces (Poisson arrivals, N from 1 to 16,
20..400 steps) run through the real policy functions under both policies, on a mixed fleet (3 nodes of 4
devices at speeds 1, 1/2, 1/3) and, as a control, a uniform one. The speed-aware policy runs twice: given
the true speeds as priors, and learning them from noisy reports (re-laying jobs out through the gate).
With --gap it also measures the placer's heuristic against the exact search (N <= 64).

    .venv/bin/python scripts/sim_placement.py [--seeds 10] [--jobs 60] [--mean-gap 800] [--gap 0]

Last line: sim_jct_speedup=X.XX (mean JCT uniform / speed-aware learning the speeds, mixed fleet).
"""

from __future__ import annotations

import argparse
import time

from elasticd.placement import CostModel, choose
from elasticd.placement.simulate import MIXED, UNIFORM, compare, heuristic_gap


def large(n: int) -> tuple[float, float, float]:
    """(gap, seconds exact, seconds heuristic) for one job of N workers on N free devices of 3 speeds."""
    free = [f"n{i % 8}/{i}" for i in range(n)]
    m = CostModel({d: (1.0, 0.5, 1 / 3)[i % 3] * (1 + 0.02 * ((i * 7919) % 13) / 13) for i, d in enumerate(free)})
    for k in (2, 8, 32):
        m.observe_comm("j", k, 0.2 + 0.5 * 2 * (k - 1) / k, 0)
    t0 = time.perf_counter()
    exact = choose(n, free, 1, n, m, "j", exact=True)
    t1 = time.perf_counter()
    heur = choose(n, free, 1, n, m, "j", exact=False)
    t2 = time.perf_counter()
    return heur.predicted_s / exact.predicted_s - 1, t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=60)
    ap.add_argument("--mean-gap", type=float, default=800.0, help="mean time between arrivals")
    ap.add_argument("--gap", type=int, default=0, help="also measure the heuristic on this many random jobs")
    args = ap.parse_args()
    if args.gap:
        for noise in (0.0, 0.05):
            gap = heuristic_gap(args.gap, noise, seed=1)
            worst, mean, te, th = gap.worst, gap.mean, gap.exact_s, gap.heuristic_s
            print(f"heuristic vs exact, {args.gap} jobs N<=64, speed noise +-{noise / 2:.1%}: worst gap "
                  f"{worst:.2%}, mean {mean:.4%}; search time exact {te:.2f}s heuristic {th:.2f}s")
        for n in (256, 1024):
            gap, te, th = large(n)
            print(f"N={n} on {n} devices: heuristic gap {gap:.2%}, exact {te:.2f}s, heuristic {th:.3f}s")
    seeds = range(args.seeds)
    for name, fleet in (("uniform fleet (12 x 1.0)", UNIFORM), ("mixed fleet (4 x 1, 4 x 1/2, 4 x 1/3)", MIXED)):
        uniform, oracle, learned = compare(seeds, fleet, args.jobs, args.mean_gap)
        print(f"{name}: mean JCT uniform {uniform:.1f}, speed-aware given the speeds {oracle:.1f} "
              f"({uniform / oracle:.2f}x), learning them {learned:.1f} ({uniform / learned:.2f}x)")
    print(f"traces: {args.seeds} seeds x {args.jobs} jobs, mean gap {args.mean_gap:g} (units: one worker-step "
          "at speed 1); learning: reports every 25 units, +-10% noise, 5% of them 4x spikes")
    print(f"sim_jct_speedup={uniform / learned:.2f}")


if __name__ == "__main__":
    main()
