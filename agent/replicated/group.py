"""Replicated state: one device copy of params, grads and optimizer state for every hosted worker.

In data parallelism every rank holds the same parameters and optimizer state, so an agent keeps one
copy (the one its lowest hosted rank built; agent 0's is broadcast to the others, as DDP broadcasts
rank 0's module state at construction). Hosted workers' backward passes accumulate into the shared
`.grad` (the local part of the all-reduce); the gradient flush finishes the sum over agents and
averages over N. Optimizer step, `zero_grad`, scheduler step and clipping run once per physical step;
the other hosted workers' calls return the first call's result (Singularity's "root rank runs the
update"). Buffers follow DDP's `broadcast_buffers=True`: logical rank 0's win.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from elasticd.agent.replicated.flat import by_dtype, scatter_back, sparse_gradient_modules
from elasticd.agent.replicated.ledger import GradLedger
from elasticd.agent.replicated.once import OncePerStep
from elasticd.agent.replicated.views import ReplicatedOptimizer, ReplicatedScheduler
from elasticd.agent.replicated.weak_hooks import weakly
from elasticd.agent.resize.snapshot import GroupSnapshot

if TYPE_CHECKING:
    from elasticd.agent.runtime import Runtime
    from elasticd.agent.worker import Worker


class ReplicatedGroup:
    """One `ctx.replicate(...)` call site: a shared model with its optimizer and scheduler."""

    def __init__(self, index: int, runtime: Runtime, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None, scheduler: Any | None) -> None:
        self.index = index
        self.builder = min(runtime.hosted)   # the hosted rank whose ctx.replicate built it (state.py sets it)
        self.runtime = runtime
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        sparse = sparse_gradient_modules(model)
        if sparse:
            raise ValueError(f"ctx.replicate: {', '.join(sparse[:3])} make(s) sparse gradients (sparse=True), "
                             f"which elasticd does not reduce; use sparse=False: the same training with dense "
                             f"gradients (SparseAdam becomes Adam)")
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for _, p in named]
        if optimizer is not None:
            # All of the model's parameters: a frozen one may sit in the optimizer, which skips it (MoCo
            # builds SGD over model.parameters(), its momentum encoder's frozen ones included).
            known = {id(p) for p in model.parameters()}
            stray = [p for g in optimizer.param_groups for p in g["params"] if id(p) not in known]
            if stray:
                raise ValueError("ctx.replicate: the optimizer holds parameters that are not the model's; "
                                 "build the optimizer over model.parameters() before replicating")
        self.buffers = list(model.buffers())
        ranks = runtime.hosted
        self.step_once = OncePerStep(ranks, "the replicated optimizer's step()")
        self.zero_once = OncePerStep(ranks, "the replicated optimizer's zero_grad()")
        self.sched_once = OncePerStep(ranks, "the replicated scheduler's step()")
        self.ledger = GradLedger(named, len(ranks), runtime.deterministic, writer=min(ranks))
        # AccumulateGrad nodes run their pre-hooks only when autograd accumulates into .grad (not for
        # torch.autograd.grad); a parameter holds its node weakly, so keep them for the hooks to stay.
        with torch.enable_grad():
            self._accumulators = [p.view_as(p).grad_fn.next_functions[0][0] for p in self.params]
        # Per-parameter hooks only where something must happen at the moment autograd accumulates
        # (deterministic mode's private copies, a gradient bucket to fill, the common average to scale):
        # otherwise the ledger is brought up to date once per backward pass (`before_backward`,
        # `after_backward`), which costs a loop instead of two Python calls per parameter per worker.
        self._pre_handles: list[Any] = []
        self._post_handles: list[Any] = []
        self._hook(runtime.deterministic, runtime.deterministic)
        runtime.switch_listeners.append(self._on_switch)
        # train()/eval() set flags on the one shared module tree, but each worker is in a mode of its own,
        # as each DDP process's model is: swapped at hand-overs, as the random streams are.
        self._modules = list(model.modules())
        self._module_ids = {id(m) for m in self._modules}
        self._modes: dict[int, list[bool]] = {}
        if self.buffers:
            model.register_forward_pre_hook(ThisModelOnly(self._guard_buffers))
            model.register_forward_hook(ThisModelOnly(self._restore_buffers))
        # Where each buffer sits (module, attribute, index into self.buffers): a later hosted worker's
        # forward runs on copies put in these slots, so that it never writes the shared tensors.
        index = {id(b): i for i, b in enumerate(self.buffers)}
        self._slots = [(m, name, index[id(b)]) for m in model.modules() for name, b in m._buffers.items()
                       if b is not None and id(b) in index]
        self._swapped = False
        self._forward_copies: dict[int, list[torch.Tensor]] = {}   # workers inside a forward: their copies
        # The device's first worker's buffers before each of its forwards, by step (the k-th forward of a
        # later worker reads the k-th of its step: the first worker may have begun the next step by then),
        # and how many forwards each worker has run in its step.
        self._published: collections.OrderedDict[Any, list[list[torch.Tensor]]] = collections.OrderedDict()
        self._spare: list[list[torch.Tensor]] = []
        self._forwards: dict[int, tuple[Any, int]] = {}
        # The buffers as the device's first worker left them when it last handed over: what a later worker
        # changed is set back to them when it hands over (`_keep_first_workers`).
        self._first = min(runtime.hosted)
        self._first_left: list[torch.Tensor] | None = None
        # What workers get back from ctx.replicate: views whose updates run once per physical step.
        self.opt_view = ReplicatedOptimizer(self, runtime) if optimizer is not None else None
        self.sched_view = ReplicatedScheduler(self, runtime) if scheduler is not None else None

    def _hook(self, pre: bool, post: bool) -> None:
        """Register or remove the per-parameter hooks: before accumulation (judge, then scale the common
        average or copy deterministic mode's base) and after it (note the new version, fill a bucket)."""
        self._pre_handles = _toggled(self._pre_handles, pre, lambda: [
            node.register_prehook(weakly(self._before_grad, i)) for i, node in enumerate(self._accumulators)])
        self._post_handles = _toggled(self._post_handles, post, lambda: [
            p.register_post_accumulate_grad_hook(weakly(self._on_grad, i)) for i, p in enumerate(self.params)])

    def before_backward(self, rank: int) -> None:
        """Default mode, a worker's outermost backward pass starts: judge what it changed since the runtime
        last looked; hook parameters only where this pass must act as gradients arrive (the last flush's
        average to scale before an accumulation, a gradient bucket to fill and start)."""
        self.ledger.check(rank)
        buckets = self.runtime.env.grad_buckets
        self._hook(self.ledger.any_synced(), buckets is not None and buckets.armed)

    def after_backward(self, rank: int) -> bool:
        """Default mode, that backward pass ended: whether it accumulated into any of the group's gradients."""
        return self.ledger.scan(rank)

    def _before_grad(self, i: int, _grad_outputs: Any) -> None:
        # Runs where autograd runs (an engine thread on CUDA), so ask the baton, not the thread.
        worker = self.runtime.current
        if worker is not None:
            self.ledger.before_accumulate(i, worker.rank)

    def _on_grad(self, i: int, _p: torch.Tensor) -> None:
        worker = self.runtime.current
        if worker is not None:
            worker.turn.touched_grads = True
            self.ledger.after_accumulate(i, worker.rank)
            buckets = self.runtime.env.grad_buckets
            if buckets is not None and buckets.armed:
                buckets.ready(self, i)

    def _on_switch(self, outgoing: Worker | None, incoming: Worker) -> None:
        # The outgoing worker's changes since the runtime last looked: judged before another worker runs
        # (not again when it leaves straight from a backward pass the runtime has just recorded).
        if outgoing is not None:
            if not outgoing.turn.judged:
                self.ledger.check(outgoing.rank)
            self.ledger.drop_private(outgoing.rank)
        if self.buffers and len(self.runtime.hosted) > 1:
            self._unswap()
            if outgoing is not None:
                self._keep_first_workers(outgoing.rank)
            copies = self._forward_copies.get(incoming.rank)
            if copies is not None:
                self._swap_in(copies)   # it handed over inside its forward (a collective there)
        live = [m.training for m in self._modules]
        if outgoing is not None:
            self._modes[outgoing.rank] = live
        wanted = self._modes.get(incoming.rank)
        if wanted is not None and wanted != live:
            self._set_modes(wanted)

    def _keep_first_workers(self, rank: int) -> None:
        """Each DDP rank changes only its own buffers, and rank 0's win: the shared buffers hold what the
        device's first worker made of them, whatever a later worker did meanwhile.

        `model.updates += 1` outside the forward was made once per hosted worker on the one shared buffer
        (a counter at 11-12 after 6 steps on 2 devices, exit 0); the BatchNorm of a checkpointed segment
        (torch.utils.checkpoint) runs again in each worker's backward, where no forward hook sees it, and its
        statistics took every worker's batches, 0.18-0.49 from DDP, exit 0. Compared by value, not by version
        counter: BatchNorm's kernel updates its statistics without counting a version."""
        if rank == self._first:
            self._adopt()
            self._remember_first_left()
            return
        if not self._swapped:   # (swapped: its forward's copies are in the slots)
            self._put_shared_back()   # a buffer it rebound (`model.count = model.count + 1`)
        if self._first_left is not None:
            with torch.no_grad():
                # Through .data: a graph the first worker keeps across the hand-over may have saved them.
                torch._foreach_copy_([b.data for b in self.buffers], self._first_left)

    def _remember_first_left(self) -> None:
        with torch.no_grad():
            current = [b.detach() for b in self.buffers]
            if self._first_left is None:
                self._first_left = [b.clone() for b in current]
            else:
                torch._foreach_copy_(self._first_left, current)

    def holds_module(self, m: torch.nn.Module) -> bool:
        return id(m) in self._module_ids

    def adopt_modes(self, rank: int, own: torch.nn.Module) -> None:
        """A later hosted worker, now running, takes the shared model: it is in the modes of the model that
        worker built (fresh: training), not in those an earlier worker left it in (`model.eval()` before a
        collective)."""
        modes = [m.training for m in own.modules()]
        if len(modes) == len(self._modules):
            self._modes[rank] = modes
            self._set_modes(modes)

    def _set_modes(self, modes: list[bool]) -> None:
        for m, training in zip(self._modules, modes, strict=True):
            m.training = training

    def _guard_buffers(self, _module: torch.nn.Module, _args: Any) -> None:
        worker = self.runtime.current
        if worker is None or len(self.runtime.hosted) == 1:
            return
        self._unswap()               # a forward that raised never restored them
        self._forward_copies.pop(worker.rank, None)
        step = worker.ctx.step if worker.ctx is not None else None
        was, count = self._forwards.get(worker.rank, (None, 0))
        k = count if was == step else 0
        self._forwards[worker.rank] = (step, k + 1)
        if worker.rank == self._first:
            # Its forwards update the shared buffers, as rank 0's own (on agent 0 it is rank 0; elsewhere it
            # starts each step from rank 0's, broadcast at the flush).
            self._adopt()
            self._publish(step, k)
            return
        # Under DDP the k-th forward of every rank starts from rank 0's buffers as they are at rank 0's k-th
        # forward (broadcast_buffers): here, as the device's first worker had them before its k-th forward
        # of this step. Were every later forward to read them as before the first worker's *last* forward,
        # a GAN's spectral-normalised discriminator, run on real and fake batches before one backward,
        # would draw its power iteration from the wrong vectors (7e-2 from DDP).
        published = self._published.get(step, [])
        source = published[min(k, len(published) - 1)] if published else self.buffers
        # Copies, not the shared tensors written and set back: autograd saves what BatchNorm reads for its
        # backward, and a GAN's G runs forward before D's step (a hand-over) and backward after; the next
        # worker's forward had bumped the shared tensors' versions and that backward refused to run.
        with torch.no_grad():
            copies = [b.detach().clone() for b in source]
        self._forward_copies[worker.rank] = copies
        self._swap_in(copies)

    def _adopt(self) -> None:
        """The device's first worker's code may rebind a buffer (`self.count = self.count + 1` in a forward
        registers a new tensor): that tensor is the shared buffer from now on; were a later worker's forward
        to put the old one back, the counter would stay 0 where DDP's reaches 9."""
        changed = False
        for m, name, i in self._slots:
            now = m._buffers.get(name)
            if now is not None and now is not self.buffers[i]:
                if now.shape != self.buffers[i].shape or now.dtype != self.buffers[i].dtype:
                    changed = True
                self.buffers[i] = now
        if changed:   # kept copies of another shape: made again
            self._published.clear()
            self._spare, self._first_left = [], None

    def _swap_in(self, copies: list[torch.Tensor]) -> None:
        for m, name, i in self._slots:
            m._buffers[name] = copies[i]
        self._swapped = True

    def _publish(self, step: Any, k: int) -> None:
        lists = self._published.get(step)
        if lists is None:
            if len(self._published) >= _PUBLISHED_STEPS:
                self._spare = self._published.popitem(last=False)[1]   # their tensors are used again
            lists = self._published[step] = []
        del lists[k:]
        with torch.no_grad():
            current = [b.detach() for b in self.buffers]
            if self._spare:
                kept = self._spare.pop()
                torch._foreach_copy_(kept, current)
            else:
                kept = [b.clone() for b in current]
        lists.append(kept)

    def _restore_buffers(self, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        worker = self.runtime.current
        if worker is not None:
            self._forward_copies.pop(worker.rank, None)
        self._unswap()

    def _unswap(self) -> None:
        if self._swapped:
            self._put_shared_back()
            self._swapped = False

    def _put_shared_back(self) -> None:
        for m, name, i in self._slots:
            m._buffers[name] = self.buffers[i]

    def broadcast_state(self) -> None:
        """Make every agent start from agent 0's parameters and buffers (DDP's constructor does this)."""
        phys = self.runtime.phys
        if phys.world == 1:
            return
        with torch.no_grad():
            for tensors in by_dtype([*self.model.parameters(), *self.buffers]).values():
                flat = torch.cat([t.detach().reshape(-1) for t in tensors])
                phys.broadcast_(flat, 0)
                scatter_back(flat, tensors)
        self.ledger.record()

    def snapshot(self) -> GroupSnapshot:
        """The replicated state at the step boundary where the agents stopped, gradients included."""
        model = self.model.state_dict()
        return GroupSnapshot(model=model,
                             optimizer=self.optimizer.state_dict() if self.optimizer is not None else None,
                             scheduler=self.scheduler.state_dict() if self.scheduler is not None else None,
                             grads=self.ledger.common_grads(),
                             buffers={n: b.detach() for n, b in self.model.named_buffers() if n not in model})

    def load(self, snap: GroupSnapshot) -> None:
        """Adopt the replicated state saved at the step boundary where the job was resized."""
        self.model.load_state_dict(snap.model)
        if snap.buffers:
            held = dict(self.model.named_buffers())
            with torch.no_grad():
                for name, saved in snap.buffers.items():
                    if name not in held or held[name].shape != saved.shape:
                        raise RuntimeError(
                            f"elasticd: cannot give the replicated model's non-persistent buffer {name!r} its value "
                            f"from before the resize: the re-entered function built "
                            f"{'no such buffer' if name not in held else f'one of shape {tuple(held[name].shape)}'}")
                    held[name].copy_(saved)
        if self.optimizer is not None and snap.optimizer is not None:
            self.optimizer.load_state_dict(snap.optimizer)
        if self.scheduler is not None and snap.scheduler is not None:
            self.scheduler.load_state_dict(snap.scheduler)
        if snap.grads is not None:
            for p, g in zip(self.params, snap.grads, strict=True):
                p.grad = g.to(p.device) if g is not None else None
        self.ledger.after_flush()  # every rank starts from the saved gradient, as after a flush

    def sync_buffers(self) -> None:
        """At a flush: every agent takes agent 0's buffers (logical rank 0's)."""
        worker = self.runtime.current
        if self.buffers and worker is not None and len(self.runtime.hosted) > 1:
            self._keep_first_workers(worker.rank)   # the flushing worker's changes never reach other agents
        phys = self.runtime.phys
        if phys.world > 1 and self.buffers:
            with torch.no_grad():
                for tensors in by_dtype(self.buffers).values():
                    flat = torch.cat([t.reshape(-1) for t in tensors])
                    phys.broadcast_(flat, 0)
                    # Through .data: a flush comes mid-step (at an optimizer step), where logical rank 0 may
                    # hold a graph that saved them; its agent receives the values it has.
                    scatter_back(flat, [t.data for t in tensors])
            if self._first_left is not None:   # what the first worker goes on from, and later ones get back
                self._remember_first_left()


_PUBLISHED_STEPS = 3   # steps whose published buffers are kept: the step of the device's last worker and later


def _toggled(handles: list[Any], on: bool, register: Callable[[], list[Any]]) -> list[Any]:
    """`handles` registered (by `register`) if `on`, else removed; unchanged if already so."""
    if on == bool(handles):
        return handles
    if on:
        return register()
    for h in handles:
        h.remove()
    return []


class ThisModelOnly:
    """A forward hook of the replicated model that a copy of the model does not inherit.

    `copy.deepcopy(model)` (an EMA, `AveragedModel`) copies the module's hook dicts: a bound method there
    deep-copied the whole group, process group included, which cannot be copied, and the copy's forward
    would have guarded the replicated buffers. A copy, or a pickle, gets a hook that does nothing instead.
    """

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn

    # Never traced by torch.compile: the hooks read which worker runs and its step, and dynamo guarded on
    # them, compiling the model again at every step until its limit of 8 (then running it uncompiled).
    @torch.compiler.disable
    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __deepcopy__(self, _memo: dict[int, Any]) -> _NoHook:
        return _NoHook()

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return _NoHook, ()


class _NoHook:
    """What a copy of the replicated model has where the original has a `ThisModelOnly` hook."""

    def __call__(self, *_args: Any) -> None:
        return None
