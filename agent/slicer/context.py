"""`ctx`: what the decorated function sees of its logical worker.

The surface is a contract (docs/using.md); `elasticd.agent.ddp_reference.NativeContext` offers the
same one over plain torch DDP so the same script can be checked against the real thing.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from elasticd.agent.capture.carried import mark_registered
from elasticd.agent.capture.loader import ResumableBatches
from elasticd.agent.comm.collectives import (
    AllGather,
    AllReduce,
    Barrier,
    Broadcast,
    ReduceScatter,
    validate_reduce_op,
)
from elasticd.agent.private.registry import attach
from elasticd.agent.private.swap import SwapStats
from elasticd.protocol.limits import MAX_METRIC_CHARS, MAX_METRICS

if TYPE_CHECKING:
    from elasticd.agent.runtime import Runtime
    from elasticd.agent.worker import Worker


class Work:
    """Handle of an async collective; `wait()` completes it (and any queued before it)."""

    def __init__(self, runtime: Runtime, op: Any) -> None:
        self._runtime = runtime
        self._op = op
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            self._runtime.drain(self._runtime.current)
        return True

    def is_completed(self) -> bool:
        return self._done

    def result(self) -> Any:
        self.wait()
        return self._op.result

    def _complete(self) -> None:
        self._done = True


class WorkerContext:
    """One logical worker's view: rank r of N, the agent's device, and the elastic helpers."""

    def __init__(self, runtime: Runtime, worker: Worker) -> None:
        self._rt = runtime
        self._w = worker
        # The step the function resumes at, from its first line: code before the loop runs again after every
        # resize and recovery, and `if ctx.step == 0:` is how it tells a fresh start (truncating a log file).
        self.step = worker.progress.start_step

    # -- identity -----------------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self._w.rank

    @property
    def world_size(self) -> int:
        return self._rt.workers

    @property
    def device(self) -> torch.device:
        return self._rt.device

    @property
    def local_ranks(self) -> list[int]:
        """Logical ranks time-sliced on this worker's device (this agent)."""
        return list(self._rt.hosted)

    @property
    def deterministic(self) -> bool:
        return self._rt.deterministic

    def __repr__(self) -> str:
        return f"<elasticd ctx rank={self.rank}/{self.world_size} device={self.device} step={self.step}>"

    # -- replicated state ---------------------------------------------------------------------
    def replicate(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                  lr_scheduler: Any | None = None) -> Any:
        """Share `model` (and its optimizer and scheduler) between every hosted worker, DDP-style.

        Returns `(model, optimizer)` or `(model, optimizer, lr_scheduler)` to use from here on; with no
        optimizer, just the model. Gradients are averaged over all N logical ranks at the end of each
        backward; `optimizer.step()`, `zero_grad()` and `lr_scheduler.step()` run once per physical step.
        """
        mark_registered(self._w, model, optimizer, lr_scheduler)  # carried by the replicated group, not per worker
        return self._rt.replicated.replicate(self._w, model, optimizer, lr_scheduler)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the averaged gradient of every replicated parameter, once per physical step."""
        return self._rt.replicated.clip_grad_norm_(self._w, max_norm, norm_type)

    def private(self, obj: Any) -> Any:
        """Register this worker's own device state and return `obj`: a tensor, a list/dict of tensors, an
        nn.Module (parameters, buffers and grads) or an optimizer (its state).

        The objects stay the ones you hold; under a device budget (`--device-memory`) their memory is
        swapped to host while other workers run and restored before this one runs again. Never touch
        another worker's private tensors: while swapped out they have no memory.
        """
        self._rt.boundary.restore_private(self._w, obj)  # after a resize: this registration's saved values
        return attach(self._rt).register(self.rank, obj, self._w)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients without averaging (as `DDP.no_sync`)."""
        self._w.turn.no_sync_depth += 1
        try:
            yield
        finally:
            self._w.turn.no_sync_depth -= 1

    # -- progress -----------------------------------------------------------------------------
    def steps(self, total: int) -> Iterator[int]:
        """Step indices `ctx.step .. total-1`; each boundary between two steps is a physical-step boundary."""
        self._rt.boundary.begin_steps(self._w)
        self._w.progress.total_steps = total
        for s in range(self._w.progress.start_step, total):
            self.step = s
            yield s
            self._rt.boundary.step_boundary(self._w, s)

    def batches(self, loader: Any) -> ResumableBatches:
        """An endless iterator over `loader`, epoch after epoch (`sampler.set_epoch(e)` at each start).

        The first epoch is the sampler's own (0, or what you set with `set_epoch` before); an epoch you set
        while walking it is kept too, and the walk goes on from there.
        """
        it = ResumableBatches(loader)
        self._rt.boundary.attach_loader(self._w, it)
        return it

    def log(self, **metrics: Any) -> None:
        """Per-job metrics (e.g. `loss=...`); the latest values reach `elasticd status` and `logs`.

        Numbers and short strings: what a node reports for its jobs is bounded (MAX_METRICS values, strings
        of MAX_METRIC_CHARS), so that no job's output can make its node's heartbeat too large. Beyond that a
        value is cut or dropped, with a warning in the job's own output."""
        mine = self._w.progress.metrics
        for k, v in metrics.items():
            v = float(v.item()) if isinstance(v, torch.Tensor) else v
            if isinstance(v, str) and len(v) > MAX_METRIC_CHARS:
                _warn_once(f"long {k}", f"ctx.log({k}=...): a string of {len(v)} characters; status and metrics carry the "
                           f"first {MAX_METRIC_CHARS} (print it, or write it to a file, to keep all of it)")
                v = v[:MAX_METRIC_CHARS]
            if k not in mine and len(mine) >= MAX_METRICS:
                _warn_once("many", f"ctx.log({k}=...): already {MAX_METRICS} values are logged, the most a job reports; "
                           f"{k!r} and later new names are not")
                continue
            mine[k] = v

    # -- collectives over logical ranks -------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Work | None:
        return self._collective(AllReduce(self.rank, tensor=tensor, reduce_op=validate_reduce_op(op)), async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Work | None:
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast src={src} is not a logical rank of {self.world_size}")
        return self._collective(Broadcast(self.rank, tensor=tensor, src=src), async_op)

    def all_gather(self, tensor: torch.Tensor, async_op: bool = False) -> list[torch.Tensor] | Work:
        op = AllGather(self.rank, tensor=tensor)
        work = self._collective(op, True)
        if async_op:
            return work
        work.wait()
        return op.result

    def reduce_scatter(self, output: torch.Tensor, inputs: list[torch.Tensor] | torch.Tensor, op: str = "sum",
                       async_op: bool = False) -> Work | None:
        """`output` becomes the reduction over all ranks of their `inputs[rank]`.

        `inputs`: N tensors shaped like `output`, or one tensor of N such chunks along dim 0.
        """
        n = self.world_size
        if isinstance(inputs, torch.Tensor):
            if inputs.numel() != n * output.numel() or inputs.dtype != output.dtype:
                raise ValueError(f"reduce_scatter: input must hold {n} chunks shaped like the output "
                                 f"{tuple(output.shape)} {output.dtype}, got {tuple(inputs.shape)} {inputs.dtype}")
            stack = inputs.detach().reshape(n, *output.shape).clone()  # the flush reduces in place
        else:
            if len(inputs) != n or any(t.shape != output.shape or t.dtype != output.dtype for t in inputs):
                raise ValueError(f"reduce_scatter: needs {n} inputs shaped like the output {tuple(output.shape)}")
            stack = torch.stack([t.detach() for t in inputs])
        op_ = ReduceScatter(self.rank, output=output, inputs=stack, reduce_op=validate_reduce_op(op))
        return self._collective(op_, async_op)

    def barrier(self, async_op: bool = False) -> Work | None:
        return self._collective(Barrier(self.rank), async_op)

    def _collective(self, op: Any, async_op: bool) -> Work | None:
        work = Work(self._rt, op)
        self._rt.enqueue(self._w, op, work)
        if async_op:
            return work
        work.wait()
        return None


# The runtime's layers reach a context's worker and runtime through these, never through its private names.
def worker_of(ctx: WorkerContext) -> Worker:
    return ctx._w


def runtime_of(ctx: WorkerContext) -> Runtime:
    return ctx._rt


def private_stats(ctx: WorkerContext) -> SwapStats:
    """The private-state accounting of the device `ctx`'s worker runs on (diagnostics, tests, benchmarks)."""
    return attach(ctx._rt).stats


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)
