"""Cost of deterministic mode: `@elastic(..., deterministic=True)` vs the default, N=8 on M=1 and M=2.

Deterministic mode sums gradients over logical ranks in a fixed order, independent of M: every worker's
gradient is stashed apart at the end of its backward (no accumulation into a shared .grad), and at the
flush they are added up along a fixed tree over ranks (agent/comm/rank_tree.py): each agent sums its
block's subtrees, and the agents reduce those partial sums shard by shard (all-to-all, add, all-gather)
instead of all-reducing one locally summed buffer. It also pins torch to 1 intra-op thread per agent (so CPU kernels
reduce in the same order whatever M is; agent/process.py `_set_threads`). To separate the two costs,
the default mode also runs with that same single thread (`elasticd run --threads 1`).

All variants run as `elasticd run SCRIPT:FUNC --devices M` on scripts/_benchjob.py (an MLP on synthetic
data, per-rank batch 32). Each job times its own steps (logical rank 0 stamps every step start), so
start-up never counts. Runs one after another cannot resolve these ratios on a shared machine (a
neighbour's burst of seconds moves one run by 20-50%), so each round runs every variant at once,
interleaved (scripts/_interleave.py: set up side by side, then turns of --slice seconds while the others
are frozen; only steps wholly inside a job's own turns count); a run's figure is its median such step,
and each ratio is the median over rounds of that round's ratio. The deterministic runs must end with
bitwise-equal parameters on M=1 and M=2 (the digest column).

The last line is `deterministic_cost=X.XX`: deterministic / default seconds per step at M=2 (default
threads), the case that pays the exchange.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from dataclasses import dataclass

from _benchjob_common import (
    JOB,
    BenchError,
    elasticd_cmd,
    job_env,
    load_average,
    median,
    out_file,
    read_json,
    table,
    tempdir,
)
from _interleave import Job, compare


@dataclass(frozen=True)
class Variant:
    key: str
    devices: int
    deterministic: bool
    threads: int = 0  # --threads; 0 = elasticd's default (cores / M, or 1 in deterministic mode)

    @property
    def label(self) -> str:
        mode = "deterministic" if self.deterministic else "default"
        pinned = ", --threads 1" if self.threads else ""
        return f"{mode}, M={self.devices}{pinned}"


def _variants(devices: list[int]) -> list[Variant]:
    out = []
    for m in devices:
        out += [Variant(f"def{m}", m, False), Variant(f"def{m}t1", m, False, threads=1),
                Variant(f"det{m}", m, True)]
    return out


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=8, help="N logical workers (default 8)")
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch (default 32)")
    ap.add_argument("--width", type=int, default=512, help="MLP hidden width (default 512)")
    ap.add_argument("--steps", type=int, default=150,
                    help="steps per run, warm-up included (default 150: several turns of every variant)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed first steps of each run (default 5)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of every variant (default 3)")
    ap.add_argument("--slice", type=float, default=1.5,
                    help="seconds each run gets the machine for, in turns (default 1.5)")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: N=4, a small model, few steps, one round (numbers not meaningful)")
    a = ap.parse_args()
    if a.quick:
        a.workers, a.width, a.steps, a.warmup, a.repeats, a.slice = 4, 64, 300, 2, 1, 0.2
    if a.steps - a.warmup < 2:
        ap.error("--steps must exceed --warmup by at least 2")
    if a.workers % 2:
        ap.error("--workers must be even (the benchmark runs M=1 and M=2, and M must divide N here)")
    return a


def main() -> None:
    a = _parse()
    variants = _variants([1, 2])
    times: dict[str, list[float]] = defaultdict(list)
    ratios: dict[tuple[str, str], list[float]] = defaultdict(list)
    digests: dict[str, set[str]] = defaultdict(set)
    threads: dict[str, int] = {}
    knobs = {"workers": a.workers, "steps": a.steps, "batch": a.batch, "width": a.width}
    with tempdir() as tmp:
        for rnd in range(a.repeats):
            # The order of turns rotates from round to round.
            order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
            jobs = []
            for v in order:
                path = out_file(tmp, v.key)
                args = ["run", f"{JOB}:{'train_det' if v.deterministic else 'train'}", "--workers", str(a.workers),
                        "--devices", str(v.devices)]
                if v.threads:
                    args += ["--threads", str(v.threads)]
                jobs.append(Job(v.key, elasticd_cmd(*args), job_env(**knobs, out=path), path))
            got = compare(jobs, a.warmup, a.slice)
            for v, job in zip(order, jobs, strict=True):
                out = read_json(job.out)
                times[v.key].append(got[v.key])
                digests[v.key].add(out["digest"])
                threads[v.key] = int(out["threads"])
            for m in (1, 2):
                ratios[(f"det{m}", f"def{m}")].append(got[f"det{m}"] / got[f"def{m}"])
                ratios[(f"det{m}", f"def{m}t1")].append(got[f"det{m}"] / got[f"def{m}t1"])
                ratios[(f"def{m}t1", f"def{m}")].append(got[f"def{m}t1"] / got[f"def{m}"])
            print(f"round {rnd + 1}/{a.repeats}: " + "  ".join(f"{k}={t * 1e3:.1f}ms" for k, t in got.items()),
                  file=sys.stderr, flush=True)

    rows = []
    for v in variants:
        m = v.devices
        vs_default = median([times[v.key][i] / times[f"def{m}"][i] for i in range(a.repeats)])
        vs_t1 = median([times[v.key][i] / times[f"def{m}t1"][i] for i in range(a.repeats)]) if v.deterministic else None
        rows.append([v.label, str(threads[v.key]), f"{median(times[v.key]) * 1e3:.2f}", f"{vs_default:.3f}",
                     "" if vs_t1 is None else f"{vs_t1:.3f}", ",".join(sorted(digests[v.key]))])
    print(f"N={a.workers} logical workers, per-rank batch {a.batch}, MLP width {a.width}, "
          f"{a.steps - a.warmup - 1} timed steps x {a.repeats} round(s); {load_average()}")
    print(table(["variant", "threads/agent", "ms/step", "vs default (same M)", "vs default --threads 1",
                 "param digest"], rows))
    det = digests["det1"] | digests["det2"]
    print(f"deterministic mode, M=1 vs M=2: {'bitwise equal' if len(det) == 1 else 'DIFFERENT'} parameters")
    for m in (1, 2):
        thread_cost = median(ratios[(f"def{m}t1", f"def{m}")])
        reduction_cost = median(ratios[(f"det{m}", f"def{m}t1")])
        print(f"M={m}: deterministic / default = {median(ratios[(f'det{m}', f'def{m}')]):.2f} "
              f"= thread pinning {thread_cost:.2f} x fixed-order reduction {reduction_cost:.2f} (medians)")
    if len(det) != 1:
        raise SystemExit("deterministic mode gave different parameters on M=1 and M=2")
    print(f"deterministic_cost={median(ratios[('det2', 'def2')]):.2f}")


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        raise SystemExit(f"benchmark failed: {e}") from None
