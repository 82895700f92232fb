"""`DistributedDataParallel` inside an elastic function: DDP's semantics over the logical world.

A script that wraps its model in DDP inside the decorated function gets this class (see
agent/compat/torch_dist.py). Each logical worker owns its model, as each DDP process does: this is the
correct but swap-heavy path; `ctx.replicate` is the cheap one. What it reproduces of torch's DDP:

- construction broadcasts logical rank 0's parameters and buffers (`init_sync=True`);
- `broadcast_buffers` / `forward_sync_buffers`: rank 0's buffers are broadcast before a forward,
  under DDP's exact condition (the previous forward ran with grad enabled and outside `no_sync`);
- the backward that follows such a forward averages the gradients over the N logical ranks, one
  flattened all-reduce per dtype, pre-divided by N like DDP's reducer; a parameter with no gradient
  on some ranks averages with zero contribution, one with no gradient on any rank keeps `grad=None`
  (DDP's `find_unused_parameters`; it is always on here, since it only adds what DDP would reject);
- `.module`, `no_sync()`, and `state_dict()` keys with DDP's `module.` prefix.

The gradient average runs at the runtime's context-switch point after backward (a backward hook of
the worker), not inside autograd. Every write into the worker's own tensors (scattering broadcast or
averaged values back) happens in the worker's thread after the flush, when its private state is
swapped in; only temporary flat buffers cross the flush.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed.distributed_c10d as c10d
from torch.utils._pytree import tree_map_only

from elasticd.agent.replicated.flat import (
    by_dtype,
    flatten_grads,
    scatter_back,
    sparse_gradient_modules,
    unflatten_grads,
)
from elasticd.agent.replicated.weak_hooks import weakly
from elasticd.agent.worker import current_worker

if TYPE_CHECKING:
    from elasticd.agent.slicer.context import WorkerContext

# Accepted for compatibility; they tune DDP's bucketing/graph handling, not what it computes.
_NO_EFFECT = {"bucket_cap_mb", "check_reduction", "gradient_as_bucket_view", "static_graph",
              "bucket_cap_mb_list", "batched_grad_copy"}
_UNSUPPORTED = {"delay_all_reduce_named_params", "param_to_hook_all_reduce", "mixed_precision", "device_mesh",
                "skip_all_reduce_unused_params"}


class LogicalDDP(torch.nn.Module):
    """DDP over the N logical ranks of an elastic function (built by `DistributedDataParallel(...)` there)."""

    def __init__(self, module: torch.nn.Module, device_ids: list[Any] | None = None, output_device: Any = None,
                 dim: int = 0, broadcast_buffers: bool | None = None, init_sync: bool = True,
                 process_group: Any = None, find_unused_parameters: bool = False,
                 forward_sync_buffers: bool | None = None, **options: Any) -> None:
        super().__init__()
        worker = current_worker()
        if worker is None or worker.ctx is None:
            raise RuntimeError("LogicalDDP only works inside an elastic function's worker")
        _check_options(process_group, options)
        sparse = sparse_gradient_modules(module)
        if sparse:
            raise NotImplementedError(f"elasticd: DistributedDataParallel over {', '.join(sparse[:3])}, which "
                                      f"make(s) sparse gradients (sparse=True), is not supported inside an elastic "
                                      f"function; use sparse=False: the same training with dense gradients "
                                      f"(SparseAdam becomes Adam)")
        self.module = module
        self.device_ids = device_ids
        self.output_device = output_device
        self.dim = dim
        self.find_unused_parameters = find_unused_parameters
        # DDP 2.13: `forward_sync_buffers` replaces `broadcast_buffers`; only the old name also skips the init sync.
        if forward_sync_buffers is not None:
            self.forward_sync_buffers, init_buffers = forward_sync_buffers, True
        else:
            self.forward_sync_buffers = init_buffers = broadcast_buffers if broadcast_buffers is not None else True
        self.broadcast_buffers = self.forward_sync_buffers
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.static_graph = bool(options.get("static_graph", False))   # read by Lightning's DDP strategy
        self._ctx: WorkerContext = worker.ctx
        self._ignored = set(getattr(module, "_ddp_params_and_buffers_to_ignore", ()))
        self._params = [p for n, p in module.named_parameters() if n not in self._ignored and p.requires_grad]
        if not self._params:
            raise RuntimeError("DistributedDataParallel is not needed when a module doesn't have any parameter "
                               "that requires a gradient.")
        _claim(self._params, worker.rank)
        self._expect_sync = False  # a forward asked for the next backward to average gradients
        self._touched = False      # a backward since the last check accumulated into our parameters
        for p in self._params:
            p.register_post_accumulate_grad_hook(weakly(self._on_grad))
        if init_sync:
            states = [p for n, p in module.named_parameters() if n not in self._ignored]
            if init_buffers:
                states += self._sync_buffers_list()
            self._broadcast_from_rank0(states)
        _register_private(self._ctx, module)
        worker.turn.backward_hooks.append(weakly(self._after_backward))  # a dropped model must be let go

    # -- forward: DDP's buffer sync and its decision whether the next backward averages ------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.require_forward_param_sync and self.forward_sync_buffers:
            buffers = self._sync_buffers_list()  # looked up each time: modules may reassign buffers
            if buffers:
                self._broadcast_from_rank0(buffers)
        if self.device_ids:
            # The user's device_ids name devices of its own process layout; this worker's device is the agent's.
            inputs, kwargs = tree_map_only(torch.Tensor, lambda t: t.to(self._ctx.device), (inputs, kwargs))
        output = self.module(*inputs, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self.require_forward_param_sync = True
            self._expect_sync = True
        else:
            self.require_forward_param_sync = False
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Forward/backward passes inside accumulate gradients locally; the first synced backward after averages them."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        raise NotImplementedError("elasticd: DDP communication hooks are not supported inside an elastic function")

    def join(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("elasticd: DDP's join() (uneven inputs) is not supported inside an elastic function")

    def _set_static_graph(self) -> None:
        """Graph-shape hint for the real reducer; nothing to do here."""
        self.static_graph = True

    def _get_ddp_logging_data(self) -> dict[str, Any]:
        """The real reducer's statistics (Lightning reads them at teardown): there is no reducer here, so
        nothing is measured, and no static-graph advice follows from it."""
        return {"can_set_static_graph": False}

    # -- gradient averaging (called by the runtime after each backward outside ctx.no_sync) -----------
    def _on_grad(self, _p: torch.Tensor) -> None:
        self._touched = True

    def _after_backward(self) -> None:
        touched, self._touched = self._touched, False
        if not (touched and self._expect_sync):
            return  # not the backward of a synced forward of this model (no_sync, or another graph)
        self._expect_sync = False
        n = self._ctx.world_size
        groups = list(by_dtype(self._params).values())
        with torch.no_grad():
            flats = []
            for params in groups:
                flat = flatten_grads(params)  # grads (zeros where None), then one used-flag per param
                flat[: -len(params)].div_(n)  # DDP divides before the sum, in the bucket
                flats.append(flat)
            # Queued together, flushed by the first wait: one logical all-reduce per dtype, one switch point.
            works = [self._ctx.all_reduce(flat, op="sum", async_op=True) for flat in flats]
            for work in works:
                work.wait()
            for flat, params in zip(flats, groups, strict=True):
                unflatten_grads(flat, params)

    # -- logical broadcasts from rank 0 ---------------------------------------------------------------
    def _sync_buffers_list(self) -> list[torch.Tensor]:
        return [b for n, b in self.module.named_buffers() if n not in self._ignored]

    def _broadcast_from_rank0(self, tensors: list[torch.Tensor]) -> None:
        groups = list(by_dtype(tensors).values())
        with torch.no_grad():
            flats = [torch.cat([t.detach().reshape(-1) for t in ts]) for ts in groups]
            works = [self._ctx.broadcast(flat, 0, async_op=True) for flat in flats]
            for work in works:
                work.wait()
            for flat, ts in zip(flats, groups, strict=True):
                scatter_back(flat, ts)


def _check_options(process_group: Any, options: dict[str, Any]) -> None:
    if process_group is not None and process_group is not c10d.GroupMember.WORLD:
        raise NotImplementedError("elasticd: DistributedDataParallel over a process group other than the default "
                                  "one is not supported inside an elastic function")
    for name, value in options.items():
        if name in _UNSUPPORTED:
            if value not in (None, False):
                raise NotImplementedError(f"elasticd: DistributedDataParallel({name}=...) is not supported "
                                          f"inside an elastic function")
        elif name not in _NO_EFFECT:
            raise TypeError(f"DistributedDataParallel got an unexpected keyword argument {name!r}")


def _claim(params: list[torch.Tensor], rank: int) -> None:
    """Refuse a model whose parameters another logical worker already wrapped: every DDP rank has its own."""
    for p in params:
        owner = getattr(p, "_elasticd_ddp_rank", rank)
        if owner != rank:
            raise RuntimeError(
                f"elasticd: this model's parameters are already wrapped in DDP by logical rank {owner}; each "
                f"worker must build its own model inside the function (a model passed to ctx.replicate is "
                f"averaged already and must not be wrapped in DDP)"
            )
    for p in params:
        p._elasticd_ddp_rank = rank  # type: ignore[attr-defined]


def _register_private(ctx: WorkerContext, module: torch.nn.Module) -> None:
    # PRIVATE-STATE SWAPPING: the single call site. A DDP-wrapped model is worker-private (every
    # logical rank has its own copy, as every DDP process does), so its parameters, gradients and
    # buffers must be swapped out to host at switch-out and back in at switch-in. That is
    # agent/private/registry.py's job (`ctx.private`); until it lands, every hosted worker's copy stays on the
    # device (correct, just not memory-bounded).
    private = getattr(ctx, "private", None)
    if private is not None:
        private(module)
