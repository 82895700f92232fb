"""What a replicated gradient holds, and what a worker's own change of it means.

Hosted workers share one `.grad` per replicated parameter. Between two gradient flushes (a *window*) it
holds the sum over hosted ranks of their logical gradients; right after a flush it holds their common
average. Under DDP each rank owns its `.grad`, so user code that clears or changes gradients changes
only its own; on the shared tensor the same call, made once per hosted worker, would wipe or compound
the other workers' gradients. This ledger tells the runtime's own changes (autograd accumulating, the
flush, once-per-step calls such as `optimizer.step`) from a worker's: it records each gradient's and
parameter's identity and version counter (`t._version`) after every change the runtime makes and compares
them at the next point where the runtime has the thread (before autograd accumulates, or in default mode
when a backward pass starts; before a flush or a once-per-step call, when a worker hands the baton over).
Autograd's accumulations are recorded as they happen (a post-accumulate hook) or, in default mode, when
the backward pass returns (`scan`), before user code can run again. Then:

- a worker that set a gradient to `None` (`model.zero_grad()`, a submodule's, `p.grad = None`) cleared
  its logical gradient. If no rank accumulated since the last flush that is the common value: cleared,
  once. If other hosted workers did, the first worker's identical call already cleared it before they
  accumulated, so the tensor they accumulated into is put back (the k-th call of every worker is one
  logical call, as for `optimizer.zero_grad`). A worker that clears after its own backward in the same
  window (between `no_sync` passes) cannot be told apart from the others: refused.
- any other change (in-place ops on `.grad` or on parameters, a new tensor assigned to `.grad`) would be
  applied once per hosted worker: refused with `ReplicatedStateError` naming it.

Several backward passes per step without `no_sync` (DDP: each all-reduces, `.grad = avg(g1) + avg(g2)`):
after the first flush the shared tensor holds the common average C, but the next window sums over hosted
ranks. So before the first accumulation into C it becomes H*C (H hosted ranks; exact for H a power of
two), and the flush's sum over agents divided by N gives C + avg(g2), as DDP's all-reduce of C + g2_r
does, with no extra copy. A gradient nobody on this agent accumulated into is scaled at the flush
instead (another agent may have). In deterministic mode each rank's gradient is stashed apart at its
switch point; there the common C is kept as `base`, every rank starts from it (copied on its first
accumulation: the one extra gradient copy, and only when a job runs several backward passes per step),
so the ordered sum over ranks of C + g2_r does not depend on M.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable

import torch

from elasticd.agent.replicated import data_attr
from elasticd.agent.replicated.flat import by_dtype, flatten_grads
from elasticd.core.errors import JobError

INSTEAD = ("clear gradients with optimizer.zero_grad() or model.zero_grad() (set_to_none=True), clip with "
           "ctx.clip_grad_norm_, scale the loss rather than the gradients, or keep such a model private to "
           "each worker (DistributedDataParallel inside the function)")


class ReplicatedStateError(JobError, RuntimeError):
    """A worker changed replicated gradients or parameters in a way hosted workers cannot share."""


class _Entry:
    """What the runtime knows of one replicated parameter beyond its tensors' identities and versions."""

    __slots__ = ("base", "base_taken", "contributors", "pristine", "privates", "synced")

    def __init__(self) -> None:
        self.contributors: set[int] = set()    # ranks whose backward accumulated into it in this window
        self.synced = False                    # holds the last flush's average, not a sum over hosted ranks
        self.base: torch.Tensor | None = None  # deterministic mode: the common gradient every rank starts from
        self.base_taken = False
        # While synced: the average as the flush left it, once the device's first worker wrote it through
        # `.data`, and the later workers' copies of it for their turn (replicated/grad_data.py).
        self.pristine: torch.Tensor | None = None
        self.privates: dict[int, torch.Tensor] = {}

    def end_window(self) -> None:
        """No longer the flush's average: what grad_data kept of it goes."""
        self.synced = False
        if self.pristine is not None or self.privates:
            self.pristine = None
            self.privates.clear()


_version = operator.attrgetter("_version")


class GradLedger:
    """One replicated group's parameters: the runtime's changes recorded, the workers' ones judged."""

    def __init__(self, named: Iterable[tuple[str, torch.nn.Parameter]], hosted: int, deterministic: bool,
                 writer: int = 0) -> None:
        named = list(named)
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.hosted = hosted
        self.writer = writer   # the device's first hosted rank: its writes through `.data` are the device's
        self._with_privates: list[_Entry] = []
        self.deterministic = deterministic
        self.entries = [_Entry() for _ in self.params]
        # The runtime's last known state, one list per field so that "did anything change?" is a few C-level
        # list operations (`_unchanged`) rather than a Python call per parameter: it is asked several times
        # per hand-over, right after a worker's compute has pushed the interpreter out of the caches.
        self.grads: list[torch.Tensor | None] = []   # what .grad should be (held: a dropped one comes back)
        self.grad_versions: list[int] = []
        self.param_versions: list[int] = []
        self.record()

    # -- the runtime's own changes ----------------------------------------------------------------
    def record(self) -> None:
        """After the runtime changed gradients or parameters (a flush, a once-per-step call): the new truth."""
        grads = [p.grad for p in self.params]
        self.grads = grads
        for i, g in enumerate(grads):
            if g is not None:
                data_attr.share(g, self, i)
        self.grad_versions = [0 if g is None else g._version for g in grads]
        self.param_versions = list(map(_version, self.params))
        for e, g in zip(self.entries, grads, strict=True):
            if g is None:   # cleared (zero_grad): the next accumulation starts a sum, nothing to scale
                e.end_window()

    def _note(self, i: int) -> None:
        p = self.params[i]
        g = p.grad
        if g is not None and g is not self.grads[i]:
            data_attr.share(g, self, i)
        self.grads[i] = g
        self.grad_versions[i] = 0 if g is None else g._version
        self.param_versions[i] = p._version

    def _unchanged(self) -> bool:
        """Every parameter and gradient is as the runtime last recorded it (the common case, checked fast)."""
        if list(map(_version, self.params)) != self.param_versions:
            return False
        grads = [p.grad for p in self.params]
        return (all(map(operator.is_, grads, self.grads))
                and [0 if g is None else g._version for g in grads] == self.grad_versions)

    def before_accumulate(self, i: int, rank: int) -> None:
        """Autograd is about to add rank's gradient into parameter i's `.grad` (an AccumulateGrad pre-hook)."""
        p, e = self.params[i], self.entries[i]
        self._judge(i, rank)
        if self.deterministic:
            self._take_base(p, e)
            if p.grad is not None and p.grad is e.base:  # the common gradient: this rank accumulates into a copy
                p.grad = p.grad.clone()
                self._note(i)
        elif e.synced:
            e.end_window()
            if p.grad is not None:
                with torch.no_grad():
                    p.grad.mul_(self.hosted)  # the common average, once per hosted rank: see the module doc
                self._note(i)

    def after_accumulate(self, i: int, rank: int) -> None:
        """Autograd added rank's gradient (a post-accumulate-grad hook): the new tensor and version are ours."""
        self.entries[i].contributors.add(rank)
        self._note(i)

    def scan(self, rank: int) -> bool:
        """After `rank`'s backward pass, run without per-parameter hooks: every gradient it changed is
        autograd's accumulation (user code cannot run between the pass and this call). Whether any was."""
        grads = [p.grad for p in self.params]
        versions = [0 if g is None else g._version for g in grads]
        known, known_versions = self.grads, self.grad_versions
        changed = False
        for i, g in enumerate(grads):
            if g is not None and (g is not known[i] or versions[i] != known_versions[i]):
                self.entries[i].contributors.add(rank)
                if g is not known[i]:   # a gradient autograd made: a new tensor, once per step at most
                    data_attr.share(g, self, i)
                known[i], known_versions[i] = g, versions[i]
                changed = True
        return changed

    def holds_average(self, i: int, grad: torch.Tensor) -> bool:
        """Parameter i's `.grad` is `grad` and holds the last flush's average, as the runtime recorded it."""
        return (self.entries[i].synced and grad is self.grads[i] and grad is self.params[i].grad
                and grad._version == self.grad_versions[i])

    def later_write(self, i: int, rank: int) -> None:
        """A later hosted worker writes through `.data` on the shared gradient. Before its own backward pass of
        the window its DDP rank's gradient is the average, on which the first worker made the same write, or
        None (what it finds is the others' sums), where the write never happens: dropped. After it, its share
        cannot be told apart from the others': refused."""
        if rank in self.entries[i].contributors:
            raise ReplicatedStateError(
                f"elasticd: logical rank {rank} changed the gradient of replicated parameter '{self.names[i]}' "
                f"through .data after its own backward pass, before the gradients were averaged (under "
                f"ctx.no_sync()). Hosted workers accumulate into one .grad, so its share cannot be told apart "
                f"from the others'; {INSTEAD}.")

    def private_copy(self, i: int, rank: int) -> torch.Tensor:
        """Later worker `rank`'s own copy of parameter i's average for the rest of its turn (grad_data.py)."""
        e = self.entries[i]
        own = e.privates.get(rank)
        if own is None:
            assert e.pristine is not None
            own = e.privates[rank] = e.pristine.clone()
            self._with_privates.append(e)
        return own

    def drop_private(self, rank: int) -> None:
        """`rank` hands over: its copies of the averages go (a list kept for this: no loop per hand-over)."""
        if self._with_privates:
            for e in self._with_privates:
                e.privates.pop(rank, None)
            self._with_privates = [e for e in self._with_privates if e.privates]

    def any_synced(self) -> bool:
        """Some gradient holds the last flush's average: scaled before the next accumulation into it."""
        return any(e.synced for e in self.entries)

    def check(self, rank: int) -> None:
        """At a point where `rank` gives the thread back to the runtime: judge what it changed since."""
        if self._unchanged():
            return
        for i in range(len(self.params)):
            self._judge(i, rank)

    # -- the flush --------------------------------------------------------------------------------
    def before_flush(self, rank: int, local_only: bool) -> list[bool]:
        """Check the last worker's changes; which gradients still hold the last average untouched.

        With `local_only` (one agent) those keep their value; otherwise they are scaled to the hosted sum
        like any other, since another agent may have accumulated into its copy.
        """
        self.check(rank)
        untouched = [e.synced and p.grad is not None for p, e in zip(self.params, self.entries, strict=True)]
        if not local_only and not self.deterministic:
            with torch.no_grad():
                for p, keep in zip(self.params, untouched, strict=True):
                    if keep:
                        p.grad.mul_(self.hosted)
        return untouched

    def after_flush(self) -> None:
        """The flush wrote every rank's average: a new window starts from it."""
        self.record()
        for g, e in zip(self.grads, self.entries, strict=True):
            e.contributors.clear()
            e.end_window()
            e.synced = g is not None
            e.base, e.base_taken = None, False

    def stash(self, rank: int, room: Callable[[torch.dtype], int]) -> dict[torch.dtype, torch.Tensor]:
        """Deterministic mode, at rank's switch point: its own gradients as flat buffers by dtype, each with
        `room(dtype)` zeros at the end; the next rank starts again from the common gradient."""
        self.check(rank)
        out = {dtype: flatten_grads(params, room(dtype)) for dtype, params in by_dtype(self.params).items()}
        for i, (p, e) in enumerate(zip(self.params, self.entries, strict=True)):
            self._take_base(p, e)
            p.grad = e.base
            self._note(i)
        return out

    def common_grads(self) -> list[torch.Tensor | None]:
        """The gradients every rank shares at a step boundary, for a resize snapshot.

        Raises:
            ReplicatedStateError: some are a sum over hosted ranks not flushed yet (a backward under
                `no_sync` in one step whose flush comes in the next), which another M cannot take over.
        """
        pending = [n for n, e in zip(self.names, self.entries, strict=True) if e.contributors]
        if pending:
            raise ReplicatedStateError(
                f"elasticd: the job was resized or stopped at a step boundary while gradients of replicated "
                f"parameters {pending} held backward passes not averaged yet (ctx.no_sync() across the end of "
                f"a step); end every step with a backward pass outside no_sync, or clear the gradients.")
        return [p.grad for p in self.params]

    @staticmethod
    def _take_base(p: torch.Tensor, e: _Entry) -> None:
        if not e.base_taken:  # the first rank to get here since the flush sees the common gradient
            e.base, e.base_taken = p.grad, True

    # -- a worker's own changes -------------------------------------------------------------------
    def _judge(self, i: int, rank: int) -> None:
        p, e, name = self.params[i], self.entries[i], self.names[i]
        if p._version != self.param_versions[i]:
            raise ReplicatedStateError(
                f"elasticd: logical rank {rank} changed replicated parameter '{name}' in place outside "
                f"the step of the optimizer ctx.replicate returned (e.g. `with torch.no_grad(): p.mul_(...)`, "
                f"`p.copy_(...)`, nn.init after ctx.replicate, stepping the original optimizer). Hosted workers share one copy of it, so each of them would apply the change "
                f"again. Make it part of the optimizer (e.g. its weight_decay), do it before ctx.replicate, or "
                f"keep such a model private to each worker (DistributedDataParallel inside the function).")
        g, known = p.grad, self.grads[i]
        if g is known:
            if g is None or g._version == self.grad_versions[i]:
                return
            raise ReplicatedStateError(
                f"elasticd: logical rank {rank} changed the gradient of replicated parameter '{name}' in place "
                f"(e.g. p.grad.mul_/div_/zero_, zero_grad(set_to_none=False), torch.nn.utils.clip_grad_* on "
                f"the model's parameters). Hosted workers share one .grad, so each of them would apply it "
                f"again, to the others' gradients as well; {INSTEAD}.")
        if g is not None:
            raise ReplicatedStateError(
                f"elasticd: logical rank {rank} assigned a new tensor to .grad of replicated parameter "
                f"'{name}'. Hosted workers share one .grad, which holds the others' gradients too; {INSTEAD}.")
        # The worker cleared the gradient: zero_grad() (set_to_none=True), a submodule's, or p.grad = None.
        if rank in e.contributors:
            raise ReplicatedStateError(
                f"elasticd: logical rank {rank} cleared the gradient of replicated parameter '{name}' after its "
                f"own backward pass in the same step (zero_grad() or p.grad = None between backward passes, "
                f"e.g. under ctx.no_sync()). Hosted workers accumulate into one .grad, so its share cannot be "
                f"told apart from theirs; clear gradients before the step's first backward pass, or after "
                f"optimizer.step().")
        if e.contributors:
            # Other hosted workers accumulated since the last flush: this worker's call is the one the
            # first of them made before accumulating. Give back what they accumulated.
            p.grad = known
            return
        self.grads[i], self.grad_versions[i] = None, 0   # nobody accumulated: cleared for all, once
        e.end_window()
