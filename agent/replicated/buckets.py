"""The default-mode gradient flush over several agents: persistent buckets, reduced while backward runs.

Flattening every gradient into a fresh buffer after the last hosted worker's backward exposes the whole
all-reduce (and an allocation of the model's size) at every flush. DDP instead all-reduces buckets of
gradients while backward still runs (Li et al., VLDB 2020: 21-38% saved by that overlap). Here the
hosted workers run one after another, and only the last one's backward completes the agent's sum, so:

- each replicated group's parameters are laid out once, per dtype, in reverse parameter order (the
  order backward produces them) into buckets closed once they reach `ELASTICD_BUCKET_KB` KiB: persistent flat
  buffers, nothing allocated per step;
- during the backward pass of the last hosted worker before a flush (`arm`: every other hosted worker
  waits at that flush), each gradient is copied into its bucket as autograd finishes it, and a complete
  bucket's sum over agents starts at once (`all_reduce_start`: gloo's own threads on CPU, NCCL's stream
  on CUDA). Buckets start strictly in layout order, the same on every agent, as collectives must;
- at the flush the rest is filled (gradients no hosted rank produced as zeros) and started, and the
  last bucket of each (group, dtype) carries the used-flags (a parameter no rank produced a gradient for
  keeps `grad=None`, as in DDP) and the step-boundary vote (comm/carried_vote.py). So only the buckets
  of the first layers, which backward finishes last, are exposed.

Gradients are copied into the buckets and back, not views of them (DDP's `gradient_as_bucket_view`):
views of one buffer share one version counter, and the ledger (replicated/ledger.py) tells a worker's
in-place change of a gradient from the runtime's by each gradient's own counter. The sums are the same
fp32 additions as one flat all-reduce; only how gloo splits the buffer differs.

`ELASTICD_BUCKET_KB=0` puts each (group, dtype) in one bucket reduced at the flush (no overlap). The
value must be the same on every agent of a job (it decides how many collectives a flush makes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from elasticd.agent.comm import host_values
from elasticd.agent.comm.carried_vote import CARRIERS, CarriedVote
from elasticd.agent.comm.physical import PhysicalGroup
from elasticd.agent.replicated.ledger import ReplicatedStateError

if TYPE_CHECKING:
    from elasticd.agent.replicated.group import ReplicatedGroup

BUCKET_ENV = "ELASTICD_BUCKET_KB"
# DDP's own default (`bucket_cap_mb=25`). A small cap buys overlap only where the all-reduce has something
# to run on while backward computes (a GPU's communication stream, an idle core); on CPU agents pinned to a
# core each bucket is one more collective on the critical path. Measured on 2 CPU cores (N=8 on
# 2 agents against DDP 2 processes x 4 accumulation, 3 interleaved rounds): 0.66M-parameter MLP 1.00x at
# 25 MiB (one bucket) and 1.01x at 0, against 1.10x at 256 KiB (three buckets).
DEFAULT_BUCKET_KB = 25 * 1024


def bucket_bytes(environ: dict[str, str] | None = None) -> int:
    """The bucket cap in bytes from ELASTICD_BUCKET_KB (0: no cap, one bucket per group and dtype).

    Raises:
        ValueError: the variable is not a non-negative integer.
    """
    raw = (os.environ if environ is None else environ).get(BUCKET_ENV, "").strip()
    if not raw:
        return DEFAULT_BUCKET_KB * 1024
    try:
        kb = int(raw)
    except ValueError:
        kb = -1
    if kb < 0:
        raise ValueError(f"{BUCKET_ENV}={raw!r}: expected a non-negative whole number of KiB (0: one bucket, "
                         f"no overlap)")
    return kb * 1024


@dataclass(slots=True, eq=False)
class Bucket:
    flat: torch.Tensor                      # persistent: gradients, then (tail bucket) flags and vote
    members: list[int]                      # indices into the group's params, in layout order
    views: list[torch.Tensor]               # each member's slice of `flat`, shaped like the parameter
    data: int                               # gradient elements at the front of `flat`
    flags: torch.Tensor | None = None       # tail bucket: one used-flag per parameter of `dtype_params`
    ballot: torch.Tensor | None = None      # tail bucket of a carrier dtype: room for the vote
    dtype_params: list[int] = field(default_factory=list)
    copied: list[bool] = field(default_factory=list)
    waiting: int = 0                        # members not copied yet in this flush
    work: Any = None                        # the started all-reduce
    cast: bool = False                      # the ballot holds this agent's vote


class GroupLayout:
    """One replicated group's buckets, and where each parameter's gradient goes."""

    def __init__(self, params: list[torch.Tensor], cap: int, vote_width: int) -> None:
        self.signature = _signature(params)
        self.buckets: list[Bucket] = []
        self.where: dict[int, tuple[Bucket, int]] = {}
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(params):
            by_dtype.setdefault(p.dtype, []).append(i)
        for dtype, indices in by_dtype.items():
            chunks: list[list[int]] = [[]]
            size = 0
            for i in reversed(indices):
                # As DDP: a bucket closes once it holds cap bytes or more, so a small parameter before a
                # large one shares its bucket instead of making a collective of its own.
                if cap and size >= cap:
                    chunks.append([])
                    size = 0
                chunks[-1].append(i)
                size += params[i].numel() * params[i].element_size()
            for k, members in enumerate(chunks):
                tail = k == len(chunks) - 1
                data = sum(params[i].numel() for i in members)
                extra = len(indices) + (vote_width if dtype in CARRIERS else 0) if tail else 0
                flat = torch.zeros(data + extra, dtype=dtype, device=params[indices[0]].device)
                views, at = [], 0
                for i in members:
                    n = params[i].numel()
                    views.append(flat[at:at + n].view_as(params[i]))
                    at += n
                b = Bucket(flat, members, views, data, copied=[False] * len(members))
                if tail:
                    b.flags = flat[data:data + len(indices)]
                    b.dtype_params = indices
                    if dtype in CARRIERS and vote_width:
                        b.ballot = flat[data + len(indices):]
                for slot, i in enumerate(members):
                    self.where[i] = (b, slot)
                self.buckets.append(b)


def _signature(params: list[torch.Tensor]) -> tuple:
    return tuple((p.dtype, p.numel(), p.device) for p in params)


class BucketedFlush:
    """The agent's buckets over every replicated group, started in one order the same on every agent."""

    def __init__(self, phys: PhysicalGroup, workers: int, vote: CarriedVote | None, cap: int) -> None:
        self.phys = phys
        self.workers = workers
        self.vote = vote
        self.cap = cap
        self.armed = False
        self._layouts: dict[int, GroupLayout] = {}
        self._order: list[Bucket] = []
        self._next = 0   # the first bucket in `_order` not started
        self.early = 0   # buckets started while a backward pass ran, over the run (benchmarks, tests)

    def _prepare(self, groups: list[ReplicatedGroup]) -> None:
        self._order = []
        width = self.vote.width if self.vote is not None else 0
        for g in groups:
            layout = self._layouts.get(g.index)
            if layout is None or layout.signature != _signature(g.params):
                layout = self._layouts[g.index] = GroupLayout(g.params, self.cap, width)
            for b in layout.buckets:
                b.copied = [False] * len(b.members)
                b.waiting = len(b.members)
                b.work, b.cast = None, False
            self._order += layout.buckets
        self._next = 0

    def arm(self, groups: list[ReplicatedGroup]) -> None:
        """The coming backward pass is the last before a flush: reduce buckets as they fill."""
        if self.armed or not self.cap:
            return   # a backward inside a backward (reentrant checkpointing) keeps the outer one's state
        self._prepare(groups)
        # Only tail buckets (a small model, or a cap above its size): nothing can start before the flush,
        # and per-parameter hooks for this pass would cost without buying any overlap.
        self.armed = any(b.flags is None for b in self._order)

    def disarm(self) -> None:
        """The armed backward ends without a flush (it produced no replicated gradient)."""
        if self._started():
            raise RuntimeError("elasticd: gradient buckets were started but no flush follows (a runtime bug)")
        self.armed = False

    def abandon(self, quiet: bool = False) -> None:
        """The armed backward raised. Before any bucket started, nothing left this agent and the worker may
        go on (a caught error); after, the other agents sum what this one can no longer match. `quiet`:
        the error is already the runtime's own refusal, which says more than this would."""
        started = self._started()
        self.armed = False
        if started and not quiet:
            raise RuntimeError(
                f"elasticd: a backward pass raised after {started} of its gradient buckets' all-reduce had "
                f"started on every agent, so this agent cannot finish the step in step with the others (the "
                f"error above is the cause)")

    def _started(self) -> int:
        """Buckets of this flush whose all-reduce has started."""
        return sum(b.work is not None for b in self._order)

    def ready(self, g: ReplicatedGroup, i: int) -> None:
        """Autograd finished parameter i's gradient in the armed backward (a post-accumulate-grad hook)."""
        layout = self._layouts.get(g.index)
        if layout is None:
            return   # a group made during this backward pass: reduced at the flush
        b, slot = layout.where[i]
        if b.work is not None:
            raise ReplicatedStateError(
                f"elasticd: the gradient of replicated parameter '{g.ledger.names[i]}' was accumulated twice "
                f"in one backward pass (e.g. reentrant checkpointing around shared weights) after its bucket's "
                f"all-reduce had started; set {BUCKET_ENV}=0 to reduce gradients only after backward")
        b.views[slot].copy_(g.params[i].grad)
        if not b.copied[slot]:
            b.copied[slot] = True
            b.waiting -= 1
        while self._next < len(self._order):
            nxt = self._order[self._next]
            if nxt.waiting or nxt.flags is not None:   # a tail bucket starts only at the flush
                break
            nxt.work = self.phys.all_reduce_start(nxt.flat)
            self._next += 1
            self.early += 1

    def flush(self, groups: list[ReplicatedGroup]) -> None:
        """Finish the sum over agents of every replicated gradient and average it over the N ranks."""
        if not self.armed:
            self._prepare(groups)
        self.armed = False
        with torch.no_grad():
            for g in groups:
                layout = self._layouts[g.index]
                for b in layout.buckets:
                    if b.work is not None:
                        continue
                    dsts, srcs = [], []
                    for slot, i in enumerate(b.members):
                        if not b.copied[slot]:
                            grad = g.params[i].grad
                            if grad is not None:
                                dsts.append(b.views[slot])
                                srcs.append(grad)
                            else:
                                b.views[slot].zero_()
                    if dsts:
                        torch._foreach_copy_(dsts, srcs)
                    if b.flags is not None:
                        used = [g.params[i].grad is not None for i in b.dtype_params]
                        if all(used):   # the usual case: no copy from the host at all
                            b.flags.fill_(1)
                        else:
                            b.flags.copy_(host_values.to_device(used, b.flat.dtype, b.flat.device))
                    if b.ballot is not None:
                        votes = self.vote.ballot(b.flat.dtype, b.flat.device) if self.vote is not None else None
                        b.cast = votes is not None
                        b.ballot.copy_(votes) if votes is not None else b.ballot.zero_()
            for b in self._order[self._next:]:
                b.work = self.phys.all_reduce_start(b.flat)
            self._next = len(self._order)
            for g in groups:
                for b in self._layouts[g.index].buckets:
                    self.phys.finish(b.work)
                    b.work = None
                    b.flat[:b.data].div_(self.workers)
            # Every tail bucket's summed used-flags and ballot (they end its buffer), in one read.
            tails = [b for g in groups for b in self._layouts[g.index].buckets if b.flags is not None]
            read = dict(zip(map(id, tails), host_values.read([b.flat[b.data:] for b in tails]), strict=True))
            for g in groups:
                for b in self._layouts[g.index].buckets:
                    if b.cast:
                        assert self.vote is not None and b.ballot is not None
                        self.vote.summed(read[id(b)][len(b.dtype_params):])
                dsts, srcs = [], []   # copied back in one call, not one per parameter
                for b in self._layouts[g.index].buckets:
                    if b.flags is None:
                        continue
                    used = read[id(b)][:len(b.dtype_params)]
                    for u, i in zip(used, b.dtype_params, strict=True):
                        p = g.params[i]
                        if u <= 0:
                            p.grad = None
                            continue
                        src, slot = self._layouts[g.index].where[i]
                        if p.grad is not None:
                            dsts.append(p.grad)
                            srcs.append(src.views[slot])
                        else:
                            p.grad = src.views[slot].clone()
                if dsts:
                    torch._foreach_copy_(dsts, srcs)
