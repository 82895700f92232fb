"""Multiplexing overhead: N logical workers time-sliced on one device vs the same math in a plain loop.

One run, side by side, on the same model and global batch (scripts/_benchjob.py: an MLP on synthetic
data, N=8 ranks x 32 samples, SGD with momentum):

  (a) ideal      a plain gradient-accumulation loop in this process: N micro-batches, loss/N each, one
                 optimizer step (what time-slicing N workers on one device can at best cost);
  (b) M=1        elasticd, N logical workers on 1 device, in this process (the decorated function called
                 directly, as `python script.py` does), same torch thread count as (a);
  (c) M=2        `elasticd run --devices 2`: two agent processes sharing the machine's cores;
  (d) torch DDP  `elasticd run --ddp`: N gloo processes of plain DistributedDataParallel, same cores;
  (e) DDP 2 x N/2  the fair anchor for (c): what a user runs on 2 devices instead, 2 gloo processes of
                 DistributedDataParallel (default settings), each accumulating N/2 micro-batches under
                 `no_sync` (`_benchjob.train_accum`), same cores;
  (f) DDP 1 x N  the fair anchor for (b): 1 DDP process accumulating N micro-batches, pinned to (b)'s core;
  (b') M=1        (b) again in a process of its own (the script run standalone), on the same core, so that
                 it can be run side by side with (f);
  (a') plain      (a) as a process of its own on that core, with glibc's malloc settings as they come: the
                 loop exactly as a user runs it. (a) in this process runs under the malloc settings the
                 runtime makes for (b) (agent/slicer/malloc.py), so that (b)/(a) is the runtime's own cost;
                 glibc's defaults give the plain loop page faults the runtime's settings avoid, and
                 (b')/(a') says what a user sees.

Each job times its own steps (logical rank 0 stamps every step start), so process start-up, imports and
rendezvous never count; the first --warmup steps are dropped and a run's figure is the median step.
The machine is shared and noisy, so runs are paired and the "vs ideal" column is the median of per-pair
ratios (a noisy moment slows both sides of a ratio): (a) and (b) alternate in --pairs short pairs
(a b, b a, ...). Runs one after another cannot resolve the few percent between the subprocess variants
(a neighbour's burst of seconds moves one run by 20-50%), so (c), (d), (e), (f) and (b') run at once,
interleaved (scripts/_interleave.py): each is set up, then they take turns of --slice seconds while the
others are frozen, and only steps wholly inside a job's own turns count; --repeats such rounds, each
sized for about --interleave-s seconds of stepping per job. The ratios are medians of per-round ratios.
The parameter checksums must agree (same math: (a) with (b), and the interleaved runs, which take more
steps, with each other), and (c) / (d) is printed (docs/benchmarks.md: elasticd on 2 devices must be
faster than DDP with N processes on the same cores). --sweep N1,N2,... repeats (c) against (e) for other N
(only subprocesses, so this process's job module keeps its N); --model-2 many for a second model whose
step is dominated by per-parameter and communication costs (many small layers); --bucket-kb K1,K2,... for
(c) at other gradient bucket sizes (ELASTICD_BUCKET_KB, agent/replicated/buckets.py; 0 = the whole flush
after backward).

(a) and (b) default to 1 torch thread, and this process to one core (--cpu): one device is one core
here. Two OpenMP threads in one process on a shared 2-core machine stall whenever a neighbour holds a
core, and unpinned worker threads migrate between cores at every hand-over (cold caches); either would
measure the neighbours and the OS scheduler instead of the runtime. (c), (d) and (e) get every core.

--profile adds instrumented (b) runs and prints where its extra time per step goes (hand-over, RNG swap,
thread wake-up, flush, step-boundary vote), measured by wrapping the runtime's methods from here (the
runtime is not modified), plus two what-ifs paired with (a): (b) without the numpy RNG swap, and also
with the one-agent gradient flush done in place (both leave this job's result unchanged).

The last line is `vs_ddp_accumulation=X.XX`: (c) / (e) seconds per step, elasticd on 2 devices over DDP on
2 devices with accumulation (goal <= 1.03); with (c) or (e) skipped, (b') / (f). Before it,
`overhead_vs_ideal=X.XX`: (b) / (a) (goal <= 1.05, docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from _benchjob_common import (
    ALL_CPUS,
    JOB,
    BenchError,
    elasticd_cmd,
    job_env,
    load_average,
    median,
    out_file,
    read_json,
    step_seconds,
    table,
    tempdir,
)
from _interleave import Job, compare

from elasticd.agent.slicer.malloc import tune_malloc

VARIANTS = ("ideal", "m1", "m2", "ddp", "acc2", "acc1", "m1p", "plain")
SUBPROCESS = ("m2", "acc2", "ddp", "acc1")
LABELS = {
    "ideal": "(a) ideal: grad-accumulation loop",
    "m1": "(b) elasticd N on 1 device (in-process)",
    "m2": "(c) elasticd N on 2 devices (elasticd run)",
    "ddp": "(d) torch DDP, N gloo processes",
    "acc2": "(e) torch DDP 2 procs x N/2 accumulation",
    "acc1": "(f) torch DDP 1 proc x N accumulation",
    "m1p": "(b') elasticd N on 1 device (own process)",
    "plain": "(a') (a) as a process of its own",
}


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=8, help="N logical workers / DDP ranks (default 8)")
    ap.add_argument("--batch", type=int, default=32, help="per-rank batch (default 32)")
    ap.add_argument("--width", type=int, default=512, help="MLP hidden width (default 512)")
    ap.add_argument("--steps", type=int, default=40, help="steps per run, warm-up included (default 40)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed first steps of each run (default 5)")
    ap.add_argument("--pairs", type=int, default=10, help="alternating (a)/(b) run pairs (default 10)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds of the interleaved subprocess runs, and of each sweep point (default 3)")
    ap.add_argument("--interleave-s", type=float, default=10.0,
                    help="seconds of stepping each interleaved run is sized for (default 10)")
    ap.add_argument("--interleave-steps", type=int, default=0,
                    help="steps of each interleaved run instead (0: sized by --interleave-s). fp32 sums in "
                         "another order drift apart with every step, and the checksums must agree to 1e-4")
    ap.add_argument("--slice", type=float, default=1.5,
                    help="seconds each interleaved run gets the machine for, in turns (default 1.5)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for (a) and (b) in this process (default 1; 0 = torch's default)")
    ap.add_argument("--cpu", type=int, default=None,
                    help="pin this process, hence (a) and (b), to this one core (default: the last allowed "
                         "core when --threads is 1; -1 = no pinning). (c) and (d) always get every core")
    ap.add_argument("--skip", default="", help="comma-separated variants to leave out: m2, ddp, acc2, acc1")
    ap.add_argument("--sweep", default="",
                    help="comma-separated further N for (c) vs (e), e.g. 8,32,64 (each must be even)")
    ap.add_argument("--model", choices=["mlp", "many", "lm", "cnn"], default="mlp",
                    help="the job's model (scripts/_benchjob.py make_model): mlp (default), many small layers, or "
                         "for a GPU a 110M-parameter transformer LM (lm) or a ResNet-50 (cnn), scripts/_benchmodels.py")
    ap.add_argument("--model-2", default="",
                    help="a second model (mlp or many) for which (c) vs (e) is also paired at --workers, e.g. many")
    ap.add_argument("--bucket-kb", default="",
                    help="comma-separated ELASTICD_BUCKET_KB values at which (c) is also paired with (e), "
                         "e.g. 0,64,256,1024 (0: no overlap; agent/replicated/buckets.py), for each model")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where (a) and (b) run (cuda: cuda:0, the only visible GPU; (c) and (d) need a GPU per "
                         "rank and are skipped). cpu hides any GPU from this process")
    ap.add_argument("--profile", action="store_true", help="also break down (b)'s time per step")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: N=4, a small model, few steps, one round (numbers not meaningful)")
    a = ap.parse_args()
    if a.quick:
        a.workers, a.width, a.steps, a.warmup, a.pairs, a.repeats = 4, 64, 6, 2, 2, 1
        # A fixed count, not one sized by (a)'s speed: on a fast machine that came to 2000 steps, over which
        # N-process DDP's fp32 sums drifted past the checksum check (6e-6 at 300 steps, 5e-5 at 1500).
        a.interleave_steps, a.slice = 300, 0.15   # several turns each, or their stepping would not overlap
    if a.steps - a.warmup < 2:
        ap.error("--steps must exceed --warmup by at least 2")
    # Before anything initialises CUDA: the in-process run (b) takes the one visible GPU, or none.
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    else:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
        a.skip = ",".join(filter(None, [a.skip, "m2", "ddp", "acc2", "acc1"]))
        a.sweep = ""
        a.model_2 = ""
        a.bucket_kb = ""
    os.environ["ELASTICD_BENCH_DEVICE"] = a.device
    return a


class Bench:
    def __init__(self, a: argparse.Namespace, tmp: str) -> None:
        self.a = a
        self.tmp = tmp
        self.knobs = {"workers": a.workers, "steps": a.steps, "batch": a.batch, "width": a.width, "model": a.model}
        # The job module reads its knobs at import: set them before this process imports it.
        os.environ.update(job_env(**self.knobs))
        sys.path.insert(0, str(JOB.parent))
        import _benchjob

        self.job = _benchjob
        # Before (a)'s first run, not only before (b)'s (the runtime sets them once per process): every (a)
        # run gets the malloc settings every (b) run has, so (b)/(a) is the runtime's own cost.
        tune_malloc()
        self.threads: dict[str, int] = {}
        self.checksums: dict[str, list[float]] = defaultdict(list)
        self.ideal_times: list[float] = []
        self.gaps: dict[str, list[float]] = defaultdict(list)  # every timed step of every run

    def run(self, variant: str) -> float:
        """One in-process run of (a) "ideal" or (b) "m1": its median seconds per step."""
        path = out_file(self.tmp, variant)
        if variant == "ideal":
            stamps, check = self.job.ideal_run(self.a.steps, self.a.workers)
            out = {"stamps": stamps, "checksum": check, "threads": torch.get_num_threads()}
        else:
            os.environ["ELASTICD_BENCH_OUT"] = path
            self.job.train()
            out = read_json(path)
        self._record(variant, out)
        seconds = step_seconds(out["stamps"], self.a.warmup)
        if variant == "ideal":
            self.ideal_times.append(seconds)
        return seconds

    def _record(self, variant: str, out: dict[str, Any]) -> None:
        self.threads[variant] = int(out["threads"])
        self.checksums[variant].append(float(out["checksum"]))
        stamps = out["stamps"]
        self.gaps[variant] += [b - a for a, b in zip(stamps[:-1], stamps[1:], strict=True)][self.a.warmup:]

    def group(self, specs: dict[str, tuple[str, dict[str, Any]]], main: bool = False) -> dict[str, float]:
        """Subprocess runs interleaved (scripts/_interleave.py): name -> (variant, point); each one's median
        seconds per clean step. `point`: other knobs (workers, model) and environment (env) than the
        main run's (--sweep, --model-2, --bucket-kb). `main`: the runs' checksums count (same N and model)."""
        jobs = []
        for name, (variant, point) in specs.items():
            jobs.append(self._job(name, variant, point))
        got = compare(jobs, self.a.warmup, self.a.slice)
        if main:
            for j in jobs:
                self._record(j.name, read_json(j.out))
        return got

    def _job(self, name: str, variant: str, point: dict[str, Any]) -> Job:
        a = self.a
        n, model = point.get("workers", a.workers), point.get("model", a.model)
        # Enough steps for about --interleave-s seconds of stepping at (c)'s pace (half (b)'s step, scaled
        # to N): the jobs must step together for many slices, start-ups aside.
        per_step = median(self.ideal_times) * n / a.workers / 2
        steps = a.interleave_steps or max(a.steps, int(a.interleave_s / max(per_step, 1e-4)))
        path = out_file(self.tmp, name)
        env = job_env(**{**self.knobs, "workers": n, "model": model, "steps": steps}, out=path)
        env.update(point.get("env", {}))
        cpus = ALL_CPUS
        if variant in ("acc1", "m1p", "plain") and a.cpu is not None and a.cpu >= 0:
            cpus = frozenset({a.cpu})  # one device is one core, as for (b)
            if a.threads:
                env["OMP_NUM_THREADS"] = str(a.threads)
        if variant == "m2":
            cmd = elasticd_cmd("run", f"{JOB}:train", "--workers", str(n), "--devices", "2")
        elif variant == "ddp":
            cmd = elasticd_cmd("run", f"{JOB}:train", "--workers", str(n), "--ddp")
        elif variant == "m1p":
            cmd = [sys.executable, str(JOB)]   # standalone: every logical worker in one process
        elif variant == "plain":
            cmd = [sys.executable, str(JOB)]
            env["ELASTICD_BENCH_IDEAL"] = "1"
        else:
            cmd = elasticd_cmd("run", f"{JOB}:train_accum", "--workers", "2" if variant == "acc2" else "1", "--ddp")
        return Job(name, cmd, env, path, cpus)


def main() -> None:
    a = _parse()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.cpu is None and a.threads == 1:
        a.cpu = max(ALL_CPUS)
    if a.cpu is not None and a.cpu >= 0:
        # Before any worker thread exists, so they all inherit it. One core for one device: otherwise the
        # OS migrates each woken worker thread to whichever core is free and (b) pays for cold caches
        # (and for a busy neighbour on the other core) at every hand-over, which (a) never does.
        os.sched_setaffinity(0, {a.cpu})
    skip = {s.strip() for s in a.skip.split(",") if s.strip()}
    if skip - set(SUBPROCESS):
        raise SystemExit(f"--skip takes {', '.join(SUBPROCESS)}, not {sorted(skip - set(SUBPROCESS))}")
    sweep = [int(n) for n in a.sweep.split(",") if n.strip()]
    if any(n % 2 for n in sweep) or a.workers % 2 and "acc2" not in skip:
        raise SystemExit("(e) splits N over 2 DDP processes: --workers and --sweep need even N (or --skip acc2)")
    variants = [v for v in VARIANTS if v not in skip and not (v in ("m1p", "plain") and "acc1" in skip)]
    times: dict[str, list[float]] = defaultdict(list)
    ratios: dict[str, list[float]] = defaultdict(list)
    m2_vs_ddp: list[float] = []
    m2_vs_acc2: list[float] = []
    m1_vs_acc1: list[float] = []
    m1_vs_plain: list[float] = []
    swept: dict[str, list[tuple[float, float]]] = defaultdict(list)
    points: list[tuple[str, dict[str, Any]]] = [(f"{a.model} N={n}", {"workers": n}) for n in sweep]
    models = [a.model] + ([a.model_2] if a.model_2 else [])
    if a.model_2:
        points.append((f"{a.model_2} N={a.workers}", {"model": a.model_2}))
    for kb in [k.strip() for k in a.bucket_kb.split(",") if k.strip()]:
        points += [(f"{m} N={a.workers} buckets {kb} KiB", {"model": m, "env": {"ELASTICD_BUCKET_KB": kb}})
                   for m in models]
    with tempdir() as tmp:
        bench = Bench(a, tmp)
        # The overhead figure rests on (a) vs (b), both in this process: many short alternating pairs
        # (a b, b a, ...) so that a neighbour's burst hits both sides of some pairs and the median ratio
        # shrugs it off.
        for i in range(a.pairs):
            pair = ("ideal", "m1") if i % 2 == 0 else ("m1", "ideal")
            got = {v: bench.run(v) for v in pair}
            for v in pair:
                times[v].append(got[v])
            ratios["ideal"].append(1.0)
            ratios["m1"].append(got["m1"] / got["ideal"])
        # The fastest tenth of all steps of the pairs: steps no neighbour interfered with, the closest
        # this shared machine gets to a dedicated core. Read before the other variants add (a) steps.
        fast = {v: _quantile(bench.gaps[v], 0.1) for v in ("ideal", "m1")}
        print(f"(a)/(b) pairs: b/a = {' '.join(f'{r:.3f}' for r in ratios['m1'])}", file=sys.stderr, flush=True)
        # The subprocess variants run at once, frozen and thawed in turns (scripts/_interleave.py): a
        # neighbour's burst then falls on every variant's slices alike. Each round is one such group.
        order = [v for v in SUBPROCESS if v in variants] + (["m1p", "plain"] if "acc1" in variants else [])
        for rnd in range(a.repeats if order else 0):
            got = bench.group({v: (v, {}) for v in order}, main=True)
            for v in order:
                times[v].append(got[v])
            if "m2" in got and "ddp" in got:
                m2_vs_ddp.append(got["m2"] / got["ddp"])
            if "m2" in got and "acc2" in got:
                m2_vs_acc2.append(got["m2"] / got["acc2"])
            if "acc1" in got:
                m1_vs_acc1.append(got["m1p"] / got["acc1"])
                m1_vs_plain.append(got["m1p"] / got["plain"])
            print(f"round {rnd + 1}/{a.repeats}: " + ", ".join(f"{v} {got[v] * 1e3:.1f}" for v in order)
                  + " ms/step", file=sys.stderr, flush=True)
        # The sweep: (c) and (e) interleaved at each further N, model and bucket size.
        for rnd in range(a.repeats if points else 0):
            for label, point in points:
                got = bench.group({"m2": ("m2", point), "acc2": ("acc2", {**point, "env": {}})})
                swept[label].append((got["m2"], got["acc2"]))
                print(f"sweep round {rnd + 1}/{a.repeats}: {label} (c) {got['m2'] * 1e3:.1f} ms/step, "
                      f"(e) {got['acc2'] * 1e3:.1f} ms/step", file=sys.stderr, flush=True)
        profile = _profile(bench) if a.profile else None

    # The interleaved runs take more steps than (a) and (b): they are checked against each other.
    ref = {v: median(bench.checksums["ideal"]) for v in ("ideal", "m1")}
    ref.update({v: median([c for u in variants if u in times and u not in ref for c in bench.checksums[u]] or [0.0])
                for v in variants if v not in ref})
    drift = {v: max(abs(c - ref[v]) / ref[v] for c in bench.checksums[v]) for v in variants if bench.checksums[v]}
    rows = [[LABELS[v], str(bench.threads[v]), str(len(times[v])), f"{median(times[v]) * 1e3:.2f}",
             f"{median(ratios[v]):.3f}", f"{min(ratios[v]):.2f}-{max(ratios[v]):.2f}", f"{drift[v]:.1e}"]
            for v in ("ideal", "m1")]
    interleaved = [[LABELS[v], str(bench.threads[v]), str(len(times[v])), f"{median(times[v]) * 1e3:.2f}",
                    f"{drift[v]:.1e}"] for v in variants if v in drift and v not in ("ideal", "m1")]
    print(f"N={a.workers} logical workers, per-rank batch {a.batch}, model {a.model}{f' (width {a.width})' if a.model == 'mlp' else ''} "
          f"({sum(p.numel() for p in bench.job.make_model().parameters()) / 1e6:.2f}M params), "
          f"{a.steps - a.warmup - 1} timed steps per run; (a), (b) pinned to "
          f"{'core ' + str(a.cpu) if a.cpu is not None and a.cpu >= 0 else 'no core'}; {load_average()}")
    print(table(["variant", "threads/proc", "runs", "ms/step", "vs ideal", "range", "checksum Δ"], rows))
    if interleaved:
        print(f"run interleaved, {a.repeats} round(s) of {a.slice:g} s slices (median of clean steps per run):")
        print(table(["variant", "threads/proc", "rounds", "ms/step", "checksum Δ (vs their median)"], interleaved))
    print(f"(b) / (a) on the fastest 10% of steps (p10 of {len(bench.gaps['m1'])} steps each, pairs pooled): "
          f"{fast['m1'] / fast['ideal']:.2f} ({fast['m1'] * 1e3:.2f} / {fast['ideal'] * 1e3:.2f} ms)")
    if m2_vs_ddp:
        print(f"(c) elasticd on 2 devices / (d) torch DDP with {a.workers} processes: {median(m2_vs_ddp):.2f} "
              f"(median of {len(m2_vs_ddp)} interleaved rounds; goal < 1: faster than DDP on the same cores)")
    if m2_vs_acc2:
        print(f"(c) elasticd on 2 devices / (e) DDP 2 processes x {a.workers // 2} accumulation: "
              f"{median(m2_vs_acc2):.2f} (median of {len(m2_vs_acc2)} interleaved rounds, range "
              f"{min(m2_vs_acc2):.2f}-{max(m2_vs_acc2):.2f}; goal <= 1.03)")
    if m1_vs_acc1:
        print(f"(b') elasticd on 1 device / (f) DDP 1 process x {a.workers} accumulation, both one core: "
              f"{median(m1_vs_acc1):.2f} (median of {len(m1_vs_acc1)} interleaved rounds; range "
              f"{min(m1_vs_acc1):.2f}-{max(m1_vs_acc1):.2f})")
        print(f"(b') elasticd on 1 device / (a') the plain loop as its own process, both one core: "
              f"{median(m1_vs_plain):.2f} (range {min(m1_vs_plain):.2f}-{max(m1_vs_plain):.2f}; (b)/(a) above is "
              f"the same against the loop under the runtime's malloc settings)")
    if swept:
        print()
        rows = [[str(n), f"{median([c for c, _ in got]) * 1e3:.2f}", f"{median([e for _, e in got]) * 1e3:.2f}",
                 f"{median([c / e for c, e in got]):.2f}",
                 f"{min(c / e for c, e in got):.2f}-{max(c / e for c, e in got):.2f}"] for n, got in swept.items()]
        print(table(["model, N", "(c) ms/step", "(e) ms/step", "(c)/(e)", "range"], rows))
    if profile:
        print()
        print(profile)
    bad = [v for v in drift if drift[v] > 1e-4]
    if bad:
        raise SystemExit(f"variants {bad} computed different parameters than the others (same steps): relative "
                         f"checksum differences {', '.join(f'{drift[v]:.1e}' for v in bad)} > 1e-4")
    print(f"overhead_vs_ideal={median(ratios['m1']):.2f}")
    anchor = m2_vs_acc2 or m1_vs_acc1
    if anchor:
        print(f"vs_ddp_accumulation={median(anchor):.2f}")


def _quantile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    return ordered[int(q * (len(ordered) - 1))]


# -- profile --------------------------------------------------------------------------------------

class _Clock:
    """Durations of calls at named places (wrapped methods append to it)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = defaultdict(list)
        self.released: dict[int, float] = {}  # worker rank -> when its semaphore was released

    def add(self, name: str, seconds: float) -> None:
        self.calls[name].append(seconds)


@contextlib.contextmanager
def _patched(obj: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    # Restore the raw attribute (a classmethod descriptor stays a descriptor), wrap the bound value.
    raw = vars(obj)[name] if isinstance(obj, type) and name in vars(obj) else getattr(obj, name)
    setattr(obj, name, make(getattr(obj, name)))
    try:
        yield
    finally:
        setattr(obj, name, raw)


def _timed(clock: _Clock, label: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                clock.add(label, time.perf_counter() - t0)
        return wrapper
    return make


def _profile(bench: Bench) -> str:
    """Run (b) with the runtime's switch path wrapped in timers; where the time beyond (a) goes, per step.

    Wrapped (the runtime itself is untouched): `rng.capture`/`rng.restore` (RNG swap), `Runtime._hand_over`
    minus the RNG swap (switch listeners, semaphore release), the wake-up latency from a worker's semaphore
    release to that worker running again (`_wait_turn` returning; OS thread switch + GIL hand-off),
    `Runtime._flush` (the gradient flush: flatten, all-reduce, unflatten), `StepBoundary.step_boundary` (report
    + resize vote) and `Runtime.after_backward` minus its drain (enqueueing the GradSync).
    """
    from elasticd.agent.replicated.grad_sync import GradSync
    from elasticd.agent.replicated.group import ReplicatedGroup
    from elasticd.agent.runtime import Runtime
    from elasticd.agent.slicer import rng
    from elasticd.agent.slicer.boundary import StepBoundary

    clock = _Clock()

    def wait_turn(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Runtime, w: Any) -> None:
            fn(self, w)
            t = clock.released.pop(w.rank, None)
            if t is not None:
                clock.add("wake-up latency (sem release -> worker runs)", time.perf_counter() - t)
        return wrapper

    def hand_over(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Runtime, me: Any, nxt: Any) -> None:
            t0 = time.perf_counter()
            rng_calls = clock.calls["RNG capture + restore"]
            before = len(rng_calls)
            fn(self, me, nxt)
            t1 = time.perf_counter()
            clock.released[nxt.rank] = t1
            clock.add("hand-over bookkeeping (excl. RNG)", t1 - t0 - sum(rng_calls[before:]))
        return wrapper

    spent = threading.local()  # per worker thread: seconds blocked in drain during after_backward

    def drain(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Runtime, w: Any) -> None:
            t0 = time.perf_counter()
            try:
                fn(self, w)
            finally:
                spent.seconds = getattr(spent, "seconds", 0.0) + time.perf_counter() - t0
        return wrapper

    def after_backward(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Runtime, w: Any) -> None:
            # Own cost only: the drain inside hands the baton away and blocks until the flush.
            spent.seconds = 0.0
            t0 = time.perf_counter()
            try:
                fn(self, w)
            finally:
                clock.add("after_backward (queue GradSync)", time.perf_counter() - t0 - spent.seconds)
        return wrapper

    def instrumented() -> list[contextlib.AbstractContextManager[None]]:
        return [_patched(rng, "capture", _timed(clock, "RNG capture + restore")),
                _patched(rng, "restore", _timed(clock, "RNG capture + restore")),
                _patched(Runtime, "_hand_over", hand_over), _patched(Runtime, "_wait_turn", wait_turn),
                _patched(Runtime, "_flush", _timed(clock, "flush (grad average, world 1)")),
                _patched(StepBoundary, "step_boundary", _timed(clock, "step boundary (report + vote)")),
                _patched(Runtime, "drain", drain), _patched(Runtime, "after_backward", after_backward),
                _patched(ReplicatedGroup, "_on_grad", _timed(clock, "grad-accumulated hooks (per param)"))]

    def no_numpy() -> contextlib.AbstractContextManager[None]:
        return _patched(rng, "_numpy_random", lambda _original: lambda: None)

    def flush_in_place(_original: Callable[..., Any]) -> Callable[..., Any]:
        def flush(ops: list[Any], env: Any) -> None:
            # Valid only here (one agent, default mode, no buffers): the average is a division in place.
            with torch.no_grad():
                for g in ops[0].groups:
                    for p in g.params:
                        if p.grad is not None:
                            p.grad.div_(env.workers)
                    g.ledger.after_flush()  # the runtime's own change: the ledger must know it
        return flush

    # What-ifs, each run paired with (a): (b) without swapping numpy's global RNG (this job never draws
    # from numpy, so the result is the same), and additionally with the world-1 gradient flush done in
    # place instead of flatten -> divide -> unflatten. They show what those two pieces cost as a whole,
    # allocations and cache misses included, which the timers above cannot see.
    what_ifs = {"without the numpy RNG swap": [no_numpy],
                "... and with the flush dividing grads in place": [
                    no_numpy, lambda: _patched(GradSync, "flush", flush_in_place)]}
    rounds = max(2, bench.a.pairs // 2)
    what_if: dict[str, list[float]] = defaultdict(list)
    for i in range(rounds):
        with contextlib.ExitStack() as stack:
            for p in instrumented():
                stack.enter_context(p)
            bench.run("m1")
        cases = ["ideal", *what_ifs]
        cases = cases[i % len(cases):] + cases[:i % len(cases)]
        got = {}
        for case in cases:
            with contextlib.ExitStack() as stack:
                for patch in what_ifs.get(case, []):
                    stack.enter_context(patch())
                got[case] = bench.run("m1" if case in what_ifs else "ideal")
        for case in what_ifs:
            what_if[case].append(got[case] / got["ideal"])
    ideal = median(bench.ideal_times)
    steps = bench.a.steps * rounds
    rows = []
    accounted = 0.0
    for name in sorted(clock.calls, key=lambda k: -sum(clock.calls[k])):
        calls = clock.calls[name]
        # median cost x calls per step: the runtime's own cost. The mean also holds the moments this
        # process sat in the run queue (the machine is shared), shown apart in the mean column.
        per_step = median(calls) * len(calls) / steps
        accounted += per_step
        rows.append([name, f"{len(calls) / steps:.1f}", f"{median(calls) * 1e6:.1f}",
                     f"{sum(calls) / len(calls) * 1e6:.1f}", f"{per_step * 1e3:.3f}", f"{per_step / ideal * 100:.2f}%"])
    rows.append(["sum of the above", "", "", "", f"{accounted * 1e3:.3f}", f"{accounted / ideal * 100:.2f}%"])
    head = (f"where (b)'s time beyond (a) goes: {rounds} instrumented (b) runs (timers add a little), per step, "
            f"against (a)'s median {ideal * 1e3:.2f} ms/step ({len(bench.ideal_times)} runs); ms/step = median "
            f"cost x calls/step; a mean far above the median is time spent waiting for a core")
    tail = "\n".join(f"what-if: (b) {case}, {rounds} runs paired with (a): median ratio {median(r):.3f} "
                      f"(range {min(r):.2f}-{max(r):.2f})" for case, r in what_if.items())
    return head + "\n" + table(["where", "calls/step", "us/call (median)", "us/call (mean)", "ms/step", "of (a)"], rows) + "\n" + tail


if __name__ == "__main__":
    try:
        main()
    except BenchError as e:
        raise SystemExit(f"benchmark failed: {e}") from None
