"""Worker-private device state under a device budget: swapped between turns, never changed by it."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from cluster import Cluster, wait_state
from daemon_jobs import submit

import elasticd  # noqa: F401 - installs the package the way a user script does
from elasticd.agent.comm.physical import PhysicalGroup
from elasticd.agent.private.registry import DeviceMemoryError, SwapStats, attach
from elasticd.agent.runtime import Runtime, WorkerFailed
from elasticd.core.layout import hosted_ranks

CPU = torch.device("cpu")


def run_here(fn: Callable[[Any], Any], workers: int, budget: int | None, **opts: Any) -> tuple[dict, SwapStats]:
    """All workers on this process's CPU, as `train()` does, with a private-state budget."""
    runtime = Runtime(fn, workers, hosted_ranks(workers, 1, 0), PhysicalGroup(0, 1, CPU), CPU)
    store = attach(runtime, budget, **opts)
    return runtime.run(), store.stats


def nbytes(*objs: Any) -> int:
    total = 0
    for obj in objs:
        tensors = obj.parameters() if isinstance(obj, torch.nn.Module) else [obj]
        total += sum(t.untyped_storage().nbytes() for t in tensors)
    return total


# -- a job with replicated and private state --------------------------------------------------------
def adapter() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 16))


def mixed_job(ctx: Any) -> dict[str, list[torch.Tensor]]:
    torch.manual_seed(0)
    shared = torch.nn.Linear(16, 4)
    shared, opt = ctx.replicate(shared, torch.optim.SGD(shared.parameters(), lr=0.1))
    torch.manual_seed(10 + ctx.rank)  # each worker's own adapter, as a model that is not replicated
    mine = ctx.private(adapter())
    mine_opt = ctx.private(torch.optim.SGD(mine.parameters(), lr=0.05, momentum=0.9))
    ema = ctx.private(torch.zeros(2048))
    for _ in ctx.steps(6):
        x = torch.randn(8, 64)
        feats = mine(x)
        loss = shared(feats).pow(2).mean() + feats.pow(2).mean()
        opt.zero_grad()
        mine_opt.zero_grad()
        loss.backward()  # switch point: the other workers run, and this one's state may leave the device
        opt.step()
        mine_opt.step()
        ema.mul_(0.9).add_(feats.detach().mean(), alpha=0.1)
    return {"private": [p.detach().clone() for p in mine.parameters()] + [ema.clone()],
            "shared": [p.detach().clone() for p in shared.parameters()]}


def test_budget_swaps_private_state_and_results_match_unbudgeted() -> None:
    workers = 4
    a = adapter()
    # Per worker: adapter params, their grads and momentum, the ema; replicated: params and grads.
    per_worker = 3 * nbytes(a) + 2048 * 4
    replicated = 2 * nbytes(torch.nn.Linear(16, 4))
    budget = replicated + per_worker + per_worker // 2  # one worker's private state fits, two do not
    assert replicated + workers * per_worker > budget

    free, free_stats = run_here(mixed_job, workers, None)
    tight, stats = run_here(mixed_job, workers, budget)

    assert free_stats.bytes_moved == 0  # default on CPU: no budget, no swapping
    assert stats.bytes_out > 0 and stats.bytes_in > 0
    assert stats.slots_in >= workers * 6  # every turn restored the incoming worker's state
    assert 0 < stats.peak_bytes <= budget
    assert stats.over_budget == 0
    for r in range(workers):
        for key in ("private", "shared"):
            for x, y in zip(free[r][key], tight[r][key], strict=True):
                assert torch.equal(x, y), f"rank {r} {key} state changed by swapping"


def test_private_state_survives_many_switches_and_is_whole_after_the_run() -> None:
    workers, turns, n = 3, 25, 3000
    bad: list[str] = []

    def expect(rank: int, i: int, offset: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float64) * (rank + 1) + 1000 * i + offset

    def job(ctx: Any) -> dict[str, Any]:
        r = ctx.rank
        t = ctx.private(expect(r, 0, 0))
        d = ctx.private({"a": expect(r, 0, 1).float(), "ids": torch.full((n,), r, dtype=torch.int64)})
        for i in range(turns):
            if not torch.equal(t, expect(r, i, 0)) or not torch.equal(d["a"], expect(r, i, 1).float()) \
                    or not torch.equal(d["ids"], torch.full((n,), r + i, dtype=torch.int64)):
                bad.append(f"rank {r} turn {i}")
            t.add_(1000)
            d["a"].data.add_(1000)  # behind autograd's version counter: only the checksum can see it
            d["ids"].numpy()[:] += 1  # the same, through numpy
            ctx.barrier()
        return {"t": t, "d": d}

    per_worker = n * 8 + n * 4 + n * 8
    got, stats = run_here(job, workers, per_worker + per_worker // 3)
    assert not bad, f"private state changed across switches: {bad[:5]}"
    assert stats.slots_in >= workers * turns
    for r in range(workers):  # the objects themselves, read after the run: restored at its end
        assert torch.equal(got[r]["t"], expect(r, turns, 0))
        assert torch.equal(got[r]["d"]["a"], expect(r, turns, 1).float())
        assert torch.equal(got[r]["d"]["ids"], torch.full((n,), r + turns, dtype=torch.int64))


def test_dedup_skips_unchanged_slots_and_only_those() -> None:
    workers, turns = 4, 8
    sizes = {"frozen": 4096, "moving": 3072, "sneaky": 2048}  # floats; distinct sizes tell slots apart
    bad: list[str] = []

    def job(ctx: Any) -> None:
        r = ctx.rank
        frozen = ctx.private(torch.full((sizes["frozen"],), float(r)))
        moving = ctx.private(torch.zeros(sizes["moving"]))
        sneaky = ctx.private(torch.zeros(sizes["sneaky"]))
        for i in range(turns):
            if frozen.sum() != r * sizes["frozen"] or moving[0] != i or sneaky[-1] != i * (r + 1):
                bad.append(f"rank {r} turn {i}")
            moving.add_(1)
            sneaky.data.add_(r + 1)  # changed, but no version counter moves
            if i < turns - 1:
                ctx.barrier()

    # One worker's three slots fit, two workers' do not: every switch swaps whole workers. No prefetch:
    # a prefetched worker evicted again before it ran would (rightly) skip copies of its moving slots.
    budget = 4 * sum(sizes.values()) + 1000
    _, off = run_here(job, workers, budget, dedup=False, prefetch=False)
    _, on = run_here(job, workers, budget, prefetch=False)
    assert not bad, bad[:5]
    assert off.dedup_skipped == 0 and off.checksums == 0
    assert on.slots_out == off.slots_out  # same schedule; only what each swap-out copies differs
    outs = off.slots_out // 3  # swap-outs per kind of slot
    # A frozen slot is copied at its first swap-out (nothing to compare with yet), skipped ever after;
    # moving and sneaky slots are never skipped.
    assert on.dedup_skipped == outs - workers > 0
    assert on.dedup_bytes == on.dedup_skipped * sizes["frozen"] * 4
    assert on.bytes_out == off.bytes_out - on.dedup_bytes
    # Checksums: every frozen and sneaky swap-out; a moving slot only at its first (its version counter
    # proves every later change for free).
    assert on.checksums == 2 * outs + workers


def test_private_tensors_of_a_pending_collective_stay_resident_until_the_flush() -> None:
    workers, n = 4, 4096

    def job(ctx: Any) -> list[float]:
        mine = ctx.private(torch.full((n,), float(ctx.rank + 1)))
        ctx.all_reduce(mine)  # the flush writes into every worker's private tensor
        first = mine[0].item()
        mine.mul_(ctx.rank + 1)
        ctx.broadcast(mine, src=2)
        return [first, float(mine.min()), float(mine.max())]

    got, stats = run_here(job, workers, n * 4 + 100)
    total = float(sum(range(1, workers + 1)))
    for r in range(workers):
        assert got[r] == [total, total * 3, total * 3]
    assert stats.over_budget > 0  # pinned for the flush: honest about exceeding the budget


def test_a_budget_too_small_for_one_worker_fails_naming_the_rank() -> None:
    def job(ctx: Any) -> None:
        ctx.private(torch.zeros(1000 * (ctx.rank + 1)))
        ctx.barrier()

    with pytest.raises(WorkerFailed) as info:
        run_here(job, 3, 6000)
    assert info.value.rank == 1
    assert DeviceMemoryError.__name__ in info.value.message


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_a_finished_runtime_and_its_private_and_replicated_state_are_freed_once_dropped(deterministic: bool) -> None:
    """What an agent relies on at a resize (agent/process.py drops the segment's runtime, then collects):
    nothing keeps a finished runtime, its workers' private tensors or its model alive. A module-level
    runtime -> store map did, and so did deterministic mode's autograd-node hooks (held in C++), so every
    resize leaked a whole segment's device state."""
    refs: list[weakref.ref] = []

    def job(ctx: Any) -> None:
        model = torch.nn.Linear(8, 4)
        model, opt = ctx.replicate(model, torch.optim.SGD(model.parameters(), lr=0.1))
        mine = ctx.private(torch.zeros(4096))
        refs.extend([weakref.ref(mine), weakref.ref(model.weight)])
        for _ in ctx.steps(3):
            opt.zero_grad()
            model(torch.ones(2, 8) + mine[:8]).sum().backward()
            opt.step()
            mine.add_(1)

    runtime = Runtime(job, 2, hosted_ranks(2, 1, 0), PhysicalGroup(0, 1, CPU), CPU, deterministic)
    attach(runtime, 4096 * 4 + 10_000)  # room for one worker's private state: the store swaps
    runtime.run()
    assert runtime.private_store.stats.bytes_moved > 0
    dropped = weakref.ref(runtime)
    del runtime
    gc.collect()
    assert dropped() is None, [type(r).__name__ for r in gc.get_referrers(dropped())]
    assert len(refs) == 4 and all(r() is None for r in refs)


SEGMENTS_JOB = """
import gc
import os

import torch

import elasticd
from elasticd.agent.runtime import Runtime


@elasticd.elastic(workers=4, deterministic=os.environ["JOB_DETERMINISTIC"] == "1")
def train(ctx):
    model = torch.nn.Linear(8, 4)
    if os.environ["JOB_DDP"] == "1":   # a torch DDP model inside the function: elasticd's logical DDP
        model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        model, opt = ctx.replicate(model, torch.optim.SGD(model.parameters(), lr=0.1))
    mine = ctx.private(torch.zeros(16384))
    bag = ctx.private({"sum": torch.zeros(4)})
    registered = (id(mine), id(bag["sum"]))
    gc.collect()
    alive = sum(isinstance(o, Runtime) for o in gc.get_objects())
    with open(os.path.join(os.environ["JOB_OUT"], f"alive-{os.getpid()}-{ctx.rank}"), "a") as f:
        f.write(f"{alive}\\n")
    for step in ctx.steps(9):
        # The private store carries `mine` (and would swap it under a budget): after a resize the variable
        # must still be the registered tensor, with the values of this step, not a copy given back beside it.
        if (id(mine), id(bag["sum"])) != registered or float(mine[0]) != step or float(bag["sum"][0]) != step:
            raise AssertionError(f"rank {ctx.rank}, step {step}: `mine` and `bag` hold {float(mine[0])}, "
                                 f"{float(bag['sum'][0])}; the registered tensors: "
                                 f"{(id(mine), id(bag['sum'])) == registered}")
        opt.zero_grad()
        model(torch.ones(2, 8) + mine[:8]).sum().backward()
        opt.step()
        mine.add_(1)
        bag["sum"].add_(1)
"""


@pytest.mark.parametrize(("deterministic", "ddp"), [(False, False), (True, False), (False, True)],
                         ids=["default", "deterministic", "ddp-inside"])
def test_each_resize_frees_the_segment_before_it(tmp_path: Path, deterministic: bool, ddp: bool) -> None:
    """2 -> 1 -> 2 agents: every registration of private state, in every segment on every agent, finds
    exactly one runtime alive in its process: the old segments' models and private tensors were freed; and
    the variable (and the dict) holding private tensors hold the registered ones after each resize (a copy
    given back as a function local held the state twice on the GPU).
    Deterministic mode hooks every parameter's autograd node, whose hooks live in C++ (found on a GPU:
    each resize kept the finished segment's device state); so does a DDP model's post-accumulate-grad hook
    (agent/replicated/weak_hooks.py)."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(SEGMENTS_JOB))
    out = tmp_path / "out"
    out.mkdir()
    cmd = [sys.executable, "-m", "elasticd", "run", str(script), "--devices", "2", "--scale-at", "3:1,6:2"]
    env = {**os.environ, "JOB_OUT": str(out), "JOB_DETERMINISTIC": "1" if deterministic else "0",
           "JOB_DDP": "1" if ddp else "0"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = {f.name: f.read_text().split() for f in out.iterdir()}
    segments = sum(len(c) for c in counts.values())
    assert segments == 12, counts  # 4 ranks in each of the 3 segments
    assert all(c == "1" for v in counts.values() for c in v), counts


JOB = """
import os

import torch

import elasticd
from elasticd.agent.slicer.context import private_stats as stats


@elasticd.elastic(workers=4)
def train(ctx):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    model, opt = ctx.replicate(model, torch.optim.SGD(model.parameters(), lr=0.1))
    torch.manual_seed(100 + ctx.rank)
    mine = ctx.private(torch.randn(16384))  # 64 KiB per worker
    for step in ctx.steps(4):
        x = torch.randn(4, 8) + mine[:8]
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
        mine.mul_(0.5).add_(float(step))
    torch.save({"mine": mine.clone(), "params": [p.detach().clone() for p in model.parameters()],
                "stats": stats(ctx).as_dict(), "threads": torch.get_num_threads()},
               os.path.join(os.environ["JOB_OUT"], f"rank{ctx.rank}.pt"))
"""


def _elasticd_run(script: Path, out: Path, *extra: str) -> dict[int, dict]:
    out.mkdir()
    cmd = [sys.executable, "-m", "elasticd", "run", str(script), "--workers", "4", "--devices", "2", *extra]
    proc = subprocess.run(cmd, env={**os.environ, "JOB_OUT": str(out)}, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r: torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(4)}


def _check_budgeted(tight: dict[int, dict], free: dict[int, dict], budget: int) -> None:
    for agent_ranks in ([0, 1], [2, 3]):  # hosted ranks of each agent; the last to finish saw all moves
        last = tight[agent_ranks[-1]]["stats"]
        assert last["budget"] == budget
        assert last["bytes_moved"] > 0
        assert 0 < last["peak_bytes"] <= budget
        assert free[agent_ranks[-1]]["stats"]["bytes_moved"] == 0
    for r in range(4):
        assert torch.equal(tight[r]["mine"], free[r]["mine"])
        for x, y in zip(tight[r]["params"], free[r]["params"], strict=True):
            assert torch.equal(x, y)


def test_elasticd_run_with_a_device_memory_budget(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    budget = 100_000  # two workers of 64 KiB each per device: only one fits
    tight = _elasticd_run(script, tmp_path / "tight", "--device-memory", str(budget))
    free = _elasticd_run(script, tmp_path / "free")
    _check_budgeted(tight, free, budget)


def test_a_job_submitted_with_a_device_memory_budget_and_threads_gets_both_on_every_agent(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(JOB))
    budget = 100_000
    threads = (os.cpu_count() or 1) // 2 + 1   # never what the agents take by default (the cores split in two)
    free = _elasticd_run(script, tmp_path / "free")
    c = Cluster(tmp_path / "cluster")
    try:
        sd = c.daemon(cpu=2, fake=False).state_dir
        out = tmp_path / "tight"
        out.mkdir()
        job = submit(sd, str(script), {"JOB_OUT": str(out)}, "--workers", "4", "--max-devices", "2",
                     "--min-devices", "2", "--device-memory", str(budget), "--threads", str(threads))
        wait_state(sd, job, "finished", timeout=180)
    finally:
        c.cleanup()
    tight = {r: torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(4)}
    _check_budgeted(tight, free, budget)
    assert {tight[r]["threads"] for r in range(4)} == {threads}
