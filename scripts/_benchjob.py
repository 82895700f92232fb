"""The user script the benchmarks run: an MLP on synthetic data, data-parallel over N logical workers.

The same file serves every variant of a benchmark, so they all compute the same thing:
- `train` / `train_det`: the `@elastic` function (default / deterministic mode) that `elasticd run`, the
  in-process runtime and the torch-DDP reference (`elasticd.agent.ddp_reference`) call with their own `ctx`;
- `train_accum`: the fair anchor, run under `elasticd run --ddp --workers M`: M real DDP processes,
  each accumulating N/M micro-batches under `no_sync` (what a user runs on M devices instead);
- `make_model`, `batch`, `ideal_run`: the same model and data for the plain gradient-accumulation loop
  that the multiplexing benchmark takes as the ideal.

The job times its own steps, so process start-up, imports and rendezvous never count: logical rank 0
stamps `time.perf_counter()` at the start of every step and writes the stamps (and a checksum of the final
parameters, to prove the variants computed the same thing) as JSON to `$ELASTICD_BENCH_OUT`. On the
time-sliced runtime rank 0 is the first worker of each physical step, so the gap between two of its
stamps is one whole physical step (every hosted worker's turn plus the flush).

Knobs (environment, so `elasticd run` needs no extra arguments): ELASTICD_BENCH_WORKERS (N, default 8),
ELASTICD_BENCH_STEPS (default 40), ELASTICD_BENCH_BATCH (per rank, default 32), ELASTICD_BENCH_WIDTH
(hidden width, default 512), ELASTICD_BENCH_MODEL (`mlp`, default, or `many`: see `make_model`), ELASTICD_BENCH_OUT (where rank 0 writes its JSON), ELASTICD_BENCH_DEVICE
(`ideal_run`'s device, default cpu; the elastic function uses `ctx.device`), ELASTICD_BENCH_GO (set by
scripts/_interleave.py: wait for this file before step ELASTICD_BENCH_GO_AT, default 0, so the warm-up
steps run before the timed turns begin), ELASTICD_BENCH_IDEAL=1 (run as a script:
`ideal_run`, the plain loop, instead of the elastic function). On a GPU every stamp is
taken after a `torch.cuda.synchronize()`, in both loops alike: kernels run asynchronously, and a stamp
at launch time would time the Python, not the step.

Checkpoint knobs for the restart baseline of bench_resize (`train_ckpt`): ELASTICD_BENCH_SAVE_AT=k saves
model + optimizer state to ELASTICD_BENCH_CKPT with `torch.save` after step k and stamps the wall-clock
time (`time.time()`, comparable across processes) at which the file is on disk; ELASTICD_BENCH_RESUME=1
loads that checkpoint instead and continues from step k+1, stamping the wall-clock time at which its first
step completes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

import elasticd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _benchmodels  # noqa: E402  (beside this file, also when it runs as an agent's job module)

WORKERS = int(os.environ.get("ELASTICD_BENCH_WORKERS", "8"))
STEPS = int(os.environ.get("ELASTICD_BENCH_STEPS", "40"))
BATCH = int(os.environ.get("ELASTICD_BENCH_BATCH", "32"))
WIDTH = int(os.environ.get("ELASTICD_BENCH_WIDTH", "512"))
MODEL = os.environ.get("ELASTICD_BENCH_MODEL", "mlp")
DEPTH = 48   # layers of the "many" model
DEVICE = torch.device(os.environ.get("ELASTICD_BENCH_DEVICE", "cpu"))
GO_AT = int(os.environ.get("ELASTICD_BENCH_GO_AT", "0"))
IN_DIM, CLASSES, SAMPLES = 256, 10, 4096


def make_model() -> nn.Module:
    """Seeded, so every variant (and every logical rank) builds the same initial parameters.

    MODEL "mlp": 4 wide layers (0.66M parameters at width 512), a step dominated by compute. "many": DEPTH
    narrow layers of width 32 (about 100 parameter tensors, 55K parameters), a step dominated by what
    is paid per parameter tensor and per collective: hooks, copies, the flush. "lm" and "cnn": the GPU
    benchmarks' realistic models (scripts/_benchmodels.py), a 110M-parameter transformer LM and a ResNet-50.
    """
    torch.manual_seed(0)
    if MODEL in ("lm", "cnn"):
        return _benchmodels.build(MODEL)
    if MODEL == "many":
        layers: list[nn.Module] = [nn.Linear(IN_DIM, 32)]
        for _ in range(DEPTH):
            layers += [nn.ReLU(), nn.Linear(32, 32)]
        return nn.Sequential(*layers, nn.ReLU(), nn.Linear(32, CLASSES))
    if MODEL != "mlp":
        raise ValueError(f"ELASTICD_BENCH_MODEL={MODEL!r}: expected mlp, many, lm or cnn")
    return nn.Sequential(nn.Linear(IN_DIM, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, CLASSES))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


_DATA: tuple[torch.Tensor, torch.Tensor] | None = None


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    global _DATA
    if _DATA is None:
        g = torch.Generator().manual_seed(1234)
        x = torch.randn(SAMPLES, IN_DIM, generator=g)
        y = (x @ torch.randn(IN_DIM, CLASSES, generator=g)).argmax(dim=1)
        _DATA = (x, y)
    return _DATA


def batch(rank: int, step: int, workers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s batch at `step`: a slice of an in-memory dataset, the same in every variant.

    Slicing rather than a DataLoader keeps the benchmark about the runtime: a DataLoader's per-batch
    Python cost would be paid equally by every variant and only dilute the ratios.
    """
    if MODEL in ("lm", "cnn"):
        return _benchmodels.batch(MODEL, rank, step, workers, BATCH)
    x, y = _data()
    start = ((step * workers + rank) * BATCH) % (SAMPLES - BATCH)
    return x[start:start + BATCH], y[start:start + BATCH]


def checksum(model: nn.Module) -> float:
    """One number that moves if any parameter does (the variants must agree to fp32 round-off)."""
    with torch.no_grad():
        return float(sum(p.double().abs().sum() for p in model.parameters()))


def digest(model: nn.Module) -> str:
    """The parameters' bytes, hashed: equal digests mean bitwise-equal parameters (deterministic mode)."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def _stamp(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _await_go(step: int) -> None:
    """Under an interleaving driver (scripts/_interleave.py, which sets ELASTICD_BENCH_GO): at step GO_AT,
    say this process is ready to step, then wait for the go, so that every job's timed steps start together
    whatever its start-up cost (imports, process spawns, rendezvous, the first steps' lazy set-up). The
    warm-up steps before GO_AT run before the go: timed in turns, a job whose first steps are slow would
    start its timed window late, and the jobs' common window (what `_interleave.clean_gaps` keeps) could
    end before some job had a turn inside it."""
    go = os.environ.get("ELASTICD_BENCH_GO")
    if not go or step != GO_AT:
        return
    with open(f"{go}.ready.{os.getpid()}", "w"):
        pass
    while not os.path.exists(go):
        time.sleep(0.01)


def _write(out: dict[str, Any]) -> None:
    path = os.environ.get("ELASTICD_BENCH_OUT")
    if path:
        with open(path, "w") as f:
            json.dump(out, f)


def ideal_run(steps: int, workers: int, ready: Callable[[int], None] | None = None) -> tuple[list[float], float]:
    """The plain single-process loop with the same math: N micro-batches, loss/N each, one optimizer step.

    Returns `time.perf_counter()` stamps (start of every step, then once after the last) and the final
    parameter checksum. `ready(step)` is called before every step, once model and optimizer exist (the first
    optimizer built in a process imports torch._dynamo, seconds).
    """
    model = make_model().to(DEVICE)
    opt = make_optimizer(model)
    stamps = []
    for step in range(steps):
        if ready is not None:
            ready(step)
        stamps.append(_stamp(DEVICE))
        plain_step(model, opt, step, workers)
    stamps.append(_stamp(DEVICE))
    return stamps, checksum(model)


def plain_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, workers: int,
               backward: Callable[[torch.Tensor], Any] = torch.Tensor.backward) -> None:
    """One step of the plain loop: N micro-batches, loss/N each, one optimizer step. `backward`: how the
    loss is backpropagated (bench_handover.py passes torch's own, bypassing the runtime's wrapper)."""
    opt.zero_grad()
    for r in range(workers):
        x, y = batch(r, step, workers)
        backward(F.cross_entropy(model(x.to(DEVICE)), y.to(DEVICE)) / workers)
    opt.step()


def _body(ctx: Any) -> None:
    model = make_model().to(ctx.device)
    opt = make_optimizer(model)
    save_at = int(os.environ.get("ELASTICD_BENCH_SAVE_AT", "-1"))
    ckpt = os.environ.get("ELASTICD_BENCH_CKPT", "")
    resume = os.environ.get("ELASTICD_BENCH_RESUME") == "1"
    first = 0
    if resume:
        # Before ctx.replicate, as a torchrun script loads its checkpoint before wrapping in DDP: after it,
        # every hosted worker would write the one shared copy (refused: agent/replicated/ledger.py).
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        first = state["step"] + 1
    model, opt = ctx.replicate(model, opt)
    stamps: list[float] = []
    out: dict[str, Any] = {"threads": torch.get_num_threads()}
    for step in ctx.steps(STEPS):
        if step < first:
            continue  # the restarted job resumes after the checkpointed step (no work, no collective)
        _await_go(step)
        stamps.append(_stamp(ctx.device))
        x, y = batch(ctx.rank, step, ctx.world_size)
        loss = F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device))
        opt.zero_grad()
        loss.backward()  # the context-switch point: gradients are averaged over all N ranks here
        opt.step()
        # No ctx.log in the timed loop: the ideal loop has nothing like it, and it is not runtime cost.
        if resume and step == first and ctx.rank == 0:
            out["first_step_done_wall"] = time.time()
            _write(out)
        if step == save_at and ctx.rank == 0:
            inner = getattr(model, "module", model)
            torch.save({"model": inner.state_dict(), "opt": opt.state_dict(), "step": step}, ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)  # a reader never sees half a checkpoint
            out["saved_wall"] = time.time()
            _write(out)
    if ctx.rank == 0 and not resume:
        stamps.append(_stamp(ctx.device))
        out.update(stamps=stamps, checksum=checksum(model), digest=digest(model))
        _write(out)


def _accum_body(ctx: Any) -> None:
    """The fair anchor for N on M devices: what a user writes for M real devices, N/M accumulation steps.

    Run under `elasticd run --ddp --workers M` (real torch DDP, one gloo process per device), each of the
    M ranks runs the micro-batches of logical ranks rank*N/M .. (rank+1)*N/M - 1 under `no_sync` but the
    last, whose backward all-reduces. Wrapped in `DistributedDataParallel` directly with its defaults
    (not `ctx.replicate`, whose reference DDP finds unused parameters at a cost no user of this model
    would pay). The sum of N micro-batch gradients over N, as in `_body`.
    """
    from torch.nn.parallel import DistributedDataParallel

    if WORKERS % ctx.world_size:
        raise ValueError(f"{WORKERS} logical workers do not split over {ctx.world_size} DDP ranks")
    acc = WORKERS // ctx.world_size
    model = DistributedDataParallel(make_model().to(ctx.device))
    opt = make_optimizer(model)
    stamps: list[float] = []
    for step in ctx.steps(STEPS):
        _await_go(step)
        stamps.append(_stamp(ctx.device))
        opt.zero_grad()
        for k in range(acc):
            x, y = batch(ctx.rank * acc + k, step, WORKERS)
            # Forward too under no_sync: DDP prepares its reduction in forward.
            with model.no_sync() if k < acc - 1 else contextlib.nullcontext():
                (F.cross_entropy(model(x.to(ctx.device)), y.to(ctx.device)) / acc).backward()
        opt.step()
    if ctx.rank == 0:
        stamps.append(_stamp(ctx.device))
        _write({"threads": torch.get_num_threads(), "stamps": stamps, "checksum": checksum(model.module)})


train = elasticd.elastic(workers=WORKERS)(_body)
train_det = elasticd.elastic(workers=WORKERS, deterministic=True)(_body)
train_accum = elasticd.elastic(workers=WORKERS)(_accum_body)


def _ideal_main() -> None:
    """`ELASTICD_BENCH_IDEAL=1 python _benchjob.py`: the plain loop as a process of its own, as a user runs
    it (glibc's malloc settings as they come), timed and written like the elastic function's runs."""
    stamps, check = ideal_run(STEPS, WORKERS, ready=_await_go)
    _write({"threads": torch.get_num_threads(), "stamps": stamps, "checksum": check})


if __name__ == "__main__":
    if os.environ.get("ELASTICD_BENCH_IDEAL") == "1":
        _ideal_main()
    else:
        train()
