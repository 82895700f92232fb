"""The hand-over cost at M=1, measured step by step against the plain loop in the same thread.

bench_multiplex.py times (a) the plain gradient-accumulation loop and (b) N time-sliced workers in
separate runs a second or two long, and a neighbour's burst during one of them moves a pair's ratio by
10-30% on this shared machine. Here the two alternate inside one run, one step apart: every physical step
of the N workers is preceded, in logical rank 0's thread, by one step of the plain loop on a model of its
own (same architecture, same micro-batches, same optimizer; built before the runtime exists and stepped
through torch's own, unpatched backward, so none of the runtime's code runs in it). For each step the
ratio is

    (time from the end of the plain step to the start of the next one) / (the plain step's own time),

and a neighbour's burst slows both sides of a ratio it falls into. The figure is the median ratio over
all timed steps of all rounds. Variants, one after another in each round (the order reversed every other round):

  elasticd   the `@elastic` function of scripts/_benchjob.py's benchmark (ctx.replicate, zero_grad,
             backward, step), N logical workers on one device;
  threads    the floor of any thread-based time-slicer: N bare threads passing a baton (one C lock each)
             around the same micro-batches and one shared model, no runtime at all;
  plain      the plain loop paired with itself (the method's own bias: should read 1.00).

What the pairing cannot take out: both sides share the core's caches, and each is slowed by what the other
left there. The plain step right after N threads' turns can take longer than after another plain step (the
"plain ms/step" column: 22 / 26 / 29 ms in the plain / threads / elasticd rows of one run, 26.4 / 27.0 / 27.6
in another), and so can the workers' step after the plain one. The ratio is therefore low-noise but not the
absolute cost: it tells one version of the runtime from another (its per-round medians agree within
about +-0.01), and the threads row says how much of it any thread-based time-slicer pays.
bench_multiplex.py's separate runs stay the absolute figures.

Everything runs in this process, pinned to one core (--cpu, default the last), one torch thread, under the
runtime's malloc settings for every variant (agent/slicer/malloc.py: the runtime sets them once per
process, so the plain loop is timed under them too, as (a) is in bench_multiplex.py). The last line is
`handover_overhead=X.XX`: the elasticd variant's median ratio (goal <= 1.05 at a 25 ms step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import _benchjob as bj
import torch
import torch.nn.functional as F
from _benchjob_common import load_average, table

VARIANTS = ("elasticd", "threads", "plain")


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150, help="physical steps per run (default 150)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed first steps of each run (default 10)")
    ap.add_argument("--rounds", type=int, default=4, help="rounds, each running every variant once (default 4)")
    ap.add_argument("--cpu", type=int, default=None, help="the core to pin to (default: the last allowed)")
    ap.add_argument("--skip", default="", help="comma-separated baselines to leave out: threads, plain")
    ap.add_argument("--quick", action="store_true", help="a few steps, for a smoke test")
    a = ap.parse_args()
    if a.quick:
        a.steps, a.warmup, a.rounds = 8, 2, 1
    skip = {v for v in a.skip.split(",") if v}
    if skip - {"threads", "plain"}:
        ap.error(f"--skip: unknown {sorted(skip - {'threads', 'plain'})}; expected threads and/or plain")
    a.variants = [v for v in VARIANTS if v not in skip]
    if a.steps <= a.warmup + 1:
        ap.error("--steps must exceed --warmup + 1")
    return a


class Paired:
    """The plain loop's model, stepped once before every physical step of the variant under test."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self.model = bj.make_model()
        self.opt = bj.make_optimizer(self.model)
        # torch's own backward: the runtime wraps torch.autograd.backward (agent/slicer/backward_hook.py).
        self.backward: Callable[..., Any] = getattr(torch.autograd.backward, "__wrapped__", torch.autograd.backward)
        self.spans: list[tuple[float, float]] = []   # (start, end) of each plain step
        self.end = 0.0                               # when the variant's last step ended

    def step(self, step: int) -> None:
        start = time.perf_counter()
        bj.plain_step(self.model, self.opt, step, self.workers, self.backward)
        self.spans.append((start, time.perf_counter()))

    def ratios(self, warmup: int) -> list[float]:
        starts = [s for s, _ in self.spans[1:]] + [self.end]
        return [(nxt - end) / (end - start)
                for (start, end), nxt in zip(self.spans, starts, strict=True)][warmup:]


def run_elasticd(steps: int, workers: int) -> tuple[Paired, float]:
    import elasticd

    paired = Paired(workers)
    out: dict[str, Any] = {}

    def body(ctx: Any) -> None:
        model = bj.make_model()
        opt = bj.make_optimizer(model)
        model, opt = ctx.replicate(model, opt)
        for step in ctx.steps(steps):
            if ctx.rank == 0:
                paired.step(step)
            x, y = bj.batch(ctx.rank, step, ctx.world_size)
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if ctx.rank == 0:
            paired.end = time.perf_counter()
            out["checksum"] = bj.checksum(model)

    elasticd.elastic(workers=workers)(body)()
    return paired, out["checksum"]


def run_threads(steps: int, workers: int) -> tuple[Paired, float]:
    paired = Paired(workers)
    model = bj.make_model()
    opt = bj.make_optimizer(model)
    turns = [threading.Lock() for _ in range(workers)]
    for t in turns:
        t.acquire()
    ended = threading.Event()
    failed: list[BaseException] = []

    def worker(r: int) -> None:
        try:
            for step in range(steps):
                turns[r].acquire()
                if r == 0:
                    paired.step(step)
                    opt.zero_grad()
                x, y = bj.batch(r, step, workers)
                paired.backward(F.cross_entropy(model(x), y) / workers)
                if r == workers - 1:
                    opt.step()
                turns[(r + 1) % workers].release()
            if r == workers - 1:
                paired.end = time.perf_counter()
                ended.set()
        except BaseException as e:  # noqa: BLE001 - raised again by the main thread
            failed.append(e)
            ended.set()

    # Daemon threads: after a failure the others stay blocked on their turns and die with the process.
    for r in range(workers):
        threading.Thread(target=worker, args=(r,), daemon=True).start()
    turns[0].release()
    ended.wait()
    if failed:
        raise failed[0]
    return paired, bj.checksum(model)


def run_plain(steps: int, workers: int) -> tuple[Paired, float]:
    paired, other = Paired(workers), Paired(workers)
    for step in range(steps):
        paired.step(step)
        other.step(step)
    paired.end = time.perf_counter()
    return paired, bj.checksum(other.model)


RUNS = {"elasticd": run_elasticd, "threads": run_threads, "plain": run_plain}


def main() -> None:
    a = _parse()
    cpu = a.cpu if a.cpu is not None else max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    from elasticd.agent.slicer.malloc import tune_malloc

    tune_malloc()   # before any thread exists, as the runtime does; every variant then runs under it
    ratios: dict[str, list[float]] = {v: [] for v in a.variants}
    per_round: dict[str, list[float]] = {v: [] for v in a.variants}
    plain_ms: dict[str, list[float]] = {v: [] for v in a.variants}
    checks: dict[str, float] = {}
    for i in range(a.rounds):
        order = a.variants if i % 2 == 0 else a.variants[::-1]
        for v in order:
            paired, check = RUNS[v](a.steps, bj.WORKERS)
            rs = paired.ratios(a.warmup)
            ratios[v] += rs
            per_round[v].append(statistics.median(rs))
            plain_ms[v] += [(e - s) * 1e3 for s, e in paired.spans[a.warmup:]]
            checks[v] = check
            print(f"round {i + 1}/{a.rounds} {v}: median ratio {per_round[v][-1]:.3f}", file=sys.stderr, flush=True)
    reference = bj.checksum(Paired(bj.WORKERS).model)   # the initial parameters: every variant must move them
    drift = {v: abs(checks[v] - checks["elasticd"]) / abs(checks["elasticd"]) for v in a.variants}
    rows = []
    for v in a.variants:
        q1, _, q3 = statistics.quantiles(ratios[v], n=4)
        rows.append([v, f"{statistics.median(plain_ms[v]):.2f}", f"{statistics.median(ratios[v]):.3f}",
                     f"{q1:.3f}-{q3:.3f}", " ".join(f"{r:.3f}" for r in per_round[v]),
                     f"{drift[v]:.1e}"])
    print(f"N={bj.WORKERS} logical workers, per-rank batch {bj.BATCH}, model {bj.MODEL} (width {bj.WIDTH}), "
          f"{a.steps - a.warmup} timed steps x {a.rounds} round(s) per variant, pinned to core {cpu}, "
          f"{load_average()}")
    print(table(["variant", "plain ms/step", "median ratio", "p25-p75", "per round", "checksum Δ"], rows))
    if any(checks[v] == reference for v in a.variants):
        raise SystemExit("a variant left the parameters where they started: it did not train")
    if max(drift.values()) > 1e-5:   # fp32 round-off of a different summation order is ~1e-7
        raise SystemExit(f"the variants did not compute the same parameters (relative checksum drift {drift})")
    print(f"handover_overhead={statistics.median(ratios['elasticd']):.2f}")


if __name__ == "__main__":
    main()
