"""The real-DDP reference: run an `@elastic` function under plain torch DDP with N real processes.

elasticd promises that N logical workers on M devices compute what `DistributedDataParallel` with N
processes computes (docs/architecture.md, "What must hold"). This module is the other side of that
comparison: the same user script, unchanged, with `ctx` backed by real `torch.distributed` (gloo, CPU)
and one OS process per rank. Nothing here is shared with the time-slicing runtime on purpose, so a bug
in the runtime cannot hide in the reference.

`python -m elasticd.agent.ddp_reference run SCRIPT[:FUNC] --workers N` runs a script this way from a shell
(`elasticd run --ddp` does the same); `... worker ...` is one rank, started by elasticd/reference_launch.py.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from elasticd.agent.script import import_script
from elasticd.agent.script_main import script_args

_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    "product": dist.ReduceOp.PRODUCT,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}
_LOG_EVERY = 10  # rank 0 prints ctx.log metrics every this many steps (and on the first)


class NativeContext:
    """`ctx` for one real DDP process: the elasticd surface, with torch.distributed underneath."""

    def __init__(self, rank: int, world_size: int, deterministic: bool = False) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cpu")
        self.local_ranks = [rank]
        self.step = 0
        self.deterministic = deterministic
        self.metrics: dict[str, Any] = {}
        self._model: DistributedDataParallel | None = None

    # --- replicated state -------------------------------------------------------------------
    def replicate(self, model: torch.nn.Module, optimizer: Any = None, lr_scheduler: Any = None) -> Any:
        # DDP's default broadcast_buffers=True (renamed forward_sync_buffers in newer torch; passing either
        # name warns on one version or the other): rank 0's buffers (BatchNorm statistics) overwrite every
        # rank's before each forward, the semantics elasticd must reproduce. find_unused_parameters lets a
        # rank leave a parameter without gradient (it contributes zero to the average).
        ddp = DistributedDataParallel(model, find_unused_parameters=True)
        self._model = ddp
        if optimizer is None:   # as ctx.replicate: the model alone (a hand-written update, as word_language_model's)
            return ddp
        if lr_scheduler is None:
            return ddp, optimizer
        return ddp, optimizer, lr_scheduler

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the (already DDP-averaged) gradients of the replicated model; returns the total norm."""
        return torch.nn.utils.clip_grad_norm_(self._replicated().parameters(), max_norm, norm_type=norm_type)

    def no_sync(self) -> contextlib.AbstractContextManager[None]:
        return self._replicated().no_sync()

    def private(self, obj: Any) -> Any:
        """A real DDP process owns its device alone: nothing to swap."""
        return obj

    def _replicated(self) -> DistributedDataParallel:
        if self._model is None:
            raise RuntimeError("call ctx.replicate(model, optimizer) first")
        return self._model

    # --- loop helpers -------------------------------------------------------------------------
    def steps(self, total: int) -> Iterator[int]:
        for i in range(total):
            self.step = i
            yield i

    def batches(self, loader: Any) -> Iterator[Any]:
        """Endless batches; a new epoch starts with `sampler.set_epoch(epoch)` like a hand-written loop, from
        the epoch the sampler holds (the user's own `set_epoch` is kept, as `ctx.batches` keeps it)."""
        sampler = getattr(loader, "sampler", None)
        seen = getattr(sampler, "epoch", None)
        epoch = seen if isinstance(seen, int) else 0
        while True:
            if hasattr(sampler, "set_epoch"):
                current = getattr(sampler, "epoch", None)
                if isinstance(current, int) and current != seen:
                    epoch = current  # the user set it since
                sampler.set_epoch(epoch)
                seen = getattr(sampler, "epoch", None)
            empty = True
            for batch in loader:
                empty = False
                yield batch
            if empty:  # an endless loop over nothing would hang instead of failing
                raise ValueError(f"data loader yielded no batches in epoch {epoch} on rank {self.rank}")
            epoch += 1

    def log(self, **metrics: Any) -> None:
        self.metrics.update(metrics)
        if self.rank == 0 and self.step % _LOG_EVERY == 0:
            shown = " ".join(f"{k}={_fmt(v)}" for k, v in metrics.items())
            print(f"[native ddp] step {self.step} {shown}", flush=True)

    # --- collectives over the (real) world ----------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum", async_op: bool = False) -> Any:
        if op in ("avg", "mean"):  # gloo has no AVG
            if async_op:
                raise NotImplementedError("the DDP reference has no async 'avg' all_reduce (gloo lacks AVG)")
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
            return tensor.div_(self.world_size) if tensor.is_floating_point() else tensor
        if op not in _REDUCE_OPS:
            raise ValueError(f"unknown reduce op {op!r}; expected one of {sorted(_REDUCE_OPS)} or 'avg'")
        work = dist.all_reduce(tensor, op=_REDUCE_OPS[op], async_op=async_op)
        return work if async_op else tensor

    def reduce_scatter(self, output: torch.Tensor, inputs: Any, op: str = "sum", async_op: bool = False) -> Any:
        """`inputs`: N tensors shaped like `output`, or one tensor of N such chunks along dim 0 (as ctx's)."""
        if isinstance(inputs, torch.Tensor):
            inputs = list(inputs.reshape(self.world_size, *output.shape).unbind(0))
        return dist.reduce_scatter(output, list(inputs), op=_REDUCE_OPS[op], async_op=async_op)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(tensor, src=src)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(out, tensor.contiguous())
        return out

    def barrier(self) -> None:
        dist.barrier()


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


# --- finding the user's function ----------------------------------------------------------------------

def find_function(module: ModuleType, func: str | None) -> Any:
    """The decorated function: by name, else the only module-level object with `.fn` and `.workers`."""
    if func is not None:
        if not hasattr(module, func):
            raise LookupError(f"{module.__file__} has no function {func!r}")
        return getattr(module, func)
    # keyed by id: one function bound to two names is still one function
    found = list({id(v): v for v in vars(module).values() if hasattr(v, "fn") and hasattr(v, "workers")}.values())
    if len(found) != 1:
        raise LookupError(
            f"{module.__file__} has {len(found)} @elastic functions; name one with SCRIPT:FUNC / --func"
        )
    return found[0]


def _body(obj: Any) -> tuple[Callable[[Any], Any], bool]:
    """The undecorated body and its deterministic flag (a plain function taking ctx also works)."""
    return getattr(obj, "fn", obj), bool(getattr(obj, "deterministic", False))


# --- one rank ------------------------------------------------------------------------------------------

def _worker(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)  # N ranks share the machine's cores; oversubscription only slows the reference
    timeout = timedelta(seconds=args.pg_timeout)
    # Rank 0 hosts the rendezvous store on the socket its launcher bound and passed down (no free-port race,
    # and no torch import in the launcher); as under torchrun with env://, the store lives in rank 0.
    store = dist.TCPStore("127.0.0.1", args.store_port, is_master=args.store_fd is not None,
                          wait_for_workers=False, master_listen_fd=args.store_fd, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=args.rank, world_size=args.world, timeout=timeout)
    destroy = dist.destroy_process_group
    _group_given(args.rank, args.world)
    try:
        sys.argv = [args.script, *script_args()]   # as `python SCRIPT ARGS` (elasticd run --ddp passes ARGS)
        body, deterministic = _body(find_function(import_script(args.script), args.func))
        body(NativeContext(args.rank, args.world, deterministic))
    except BaseException:
        sys.stderr.write(f"[native ddp] rank {args.rank} failed:\n{traceback.format_exc()}")
        sys.stderr.flush()
        sys.stdout.flush()
        # Peers are blocked in collectives with us; tearing the process group down could block too.
        os._exit(1)
    destroy()
    # Leave without interpreter finalization: a rank once aborted there ("terminate called without an
    # active exception", SIGABRT) after its work was done and written, failing a CI benchmark run; gloo
    # objects torn down while the interpreter goes away are a known source of it (pytorch#179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _group_given(rank: int, world: int) -> None:
    """A function ported from a torchrun script starts its own process group (`init_process_group(backend=...)`
    from the environment torchrun sets, which each rank here gets too). The group exists already, since
    `ctx`'s collectives need it, so its own call only checks what it asks for, as elasticd's logical one
    does, and its `destroy_process_group` leaves the group to the end of the rank."""
    import torch.distributed.distributed_c10d as c10d

    def init_process_group(*args: Any, world_size: int = -1, rank: int = -1, **kwargs: Any) -> None:
        if world_size not in (-1, world) or rank not in (-1, given):
            raise ValueError(f"init_process_group(world_size={world_size}, rank={rank}) in rank {given} of a "
                             f"{world}-process reference run")

    def destroy_process_group(group: Any = None) -> None:
        return None

    given = rank
    for module in (dist, c10d):
        module.init_process_group = init_process_group  # type: ignore[assignment]
        module.destroy_process_group = destroy_process_group  # type: ignore[assignment]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elasticd.agent.ddp_reference",
                                description="run an @elastic script under plain DDP")
    sub = p.add_subparsers(dest="cmd", required=True)
    run = sub.add_parser("run", help="N gloo processes on this machine")
    run.add_argument("target", metavar="SCRIPT[:FUNC]")
    run.add_argument("--workers", type=int, default=None, help="default: the decorator's workers")
    run.add_argument("--timeout", type=float, default=3600)
    w = sub.add_parser("worker", help="one rank (started by `run`)")
    w.add_argument("--script", required=True)
    w.add_argument("--func", default=None)
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--world", type=int, required=True)
    w.add_argument("--store-port", type=int, required=True)
    w.add_argument("--store-fd", type=int, default=None, help="rank 0: the store's listening socket")
    w.add_argument("--pg-timeout", type=float, default=600)
    args = p.parse_args(argv)
    if args.cmd == "worker":
        return _worker(args)
    from elasticd.reference_launch import run_native_ddp

    script, _, func = args.target.partition(":")
    workers = args.workers
    if workers is None:  # only the launcher imports the script for this; ranks import it themselves
        workers = int(find_function(import_script(script), func or None).workers)
    return run_native_ddp(script, func or None, workers, timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
