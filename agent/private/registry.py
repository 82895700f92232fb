"""Worker-private device state (`ctx.private`): swapped out while other workers run, back before its own turn.

Replicated state is held once per device, but each logical worker may also own device state of its own:
tensors, a module that is not replicated (with its grads), an optimizer's state. With k workers on one
device that state exists k times; a per-device budget (`--device-memory BYTES`) bounds what is resident.

Policy (decided here, documented in the README):
- No budget on a CPU device: nothing is ever swapped. Host and "device" memory are the same RAM there, so
  a swap would only add copies. On CUDA the default budget is 90% of the device (`swap_cuda.default_budget`).
- With a budget, at each hand-over the incoming worker's private state is made resident, evicting other
  workers' state only as far as needed: the ones needed furthest in the future first (finished workers,
  then the worker that just ran: the baton goes round in rank order, so Belady's rule is exact). Accounted
  device bytes = private state resident + replicated state (params, grads, buffers, optimizer state) +
  released blocks kept for reuse; their peak stays under the budget unless a worker's own state plus the
  replicated state cannot fit (`DeviceMemoryError`) or tensors of pending collectives are pinned (they
  stay resident until the flush writes into them; counted in `over_budget`).
- Dedup: a slot whose tensors' version counters did not move since its host copy was taken is
  checksummed; equal to the host copy's checksum -> the copy is skipped. A moved counter proves a change,
  so a slot that changes is copied without paying for a checksum; writes that bypass version counters
  (`.data`, numpy) are still caught by the checksum.
- Prefetch: after the incoming worker's state is in, the next worker's state is restored behind it if it
  fits, on the copy thread (CPU) or the side stream (CUDA), ordered so that a worker never runs before its
  own restore has finished.
At the end of a run (or when a worker fails, before the others unwind) every slot is restored, so the
objects the user holds are whole again.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Iterable, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from elasticd.agent.private.swap import Copier, CpuMover, Slot, SwapStats, tensors_of
from elasticd.core.errors import JobError

if TYPE_CHECKING:
    from elasticd.agent.runtime import Runtime
    from elasticd.agent.worker import Worker

log = logging.getLogger(__name__)
T = TypeVar("T")


class DeviceMemoryError(JobError, MemoryError):
    """The budget cannot hold one worker's private state plus the replicated state."""


# Turns a worker must have run before its size is trusted: the first backward creates grads, the first
# optimizer step its state. Until then nothing else stays resident while it runs (no prefetch either), so
# growth we could not foresee cannot push the device over the budget.
_WARM_TURNS = 2


class _WorkerState:
    __slots__ = ("rank", "objs", "slots", "pending", "worker", "turns", "high")

    def __init__(self, rank: int, worker: Worker | None) -> None:
        self.rank = rank
        self.objs: list[Any] = []
        self.slots: dict[int, Slot] = {}
        self.pending: list[Future[None]] = []
        self.worker = worker
        self.turns = 0  # switch-outs seen after the worker ran
        self.high = 0   # most bytes seen at a switch-out

    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots.values())

    def warm(self) -> bool:
        return self.turns >= _WARM_TURNS

    def growth(self) -> int:
        """Room to keep for what the worker allocates while it runs (grads come and go within a turn)."""
        return max(0, self.high - self.nbytes())


def _referenced(op: Any) -> Iterator[torch.Tensor]:
    """Tensors a queued collective will read or write at the flush: those in its own fields."""
    if dataclasses.is_dataclass(op):
        values = [getattr(op, f.name, None) for f in dataclasses.fields(op)]
    else:
        values = list(getattr(op, "__dict__", {}).values())
    for v in values:
        yield from tensors_of(v)


class PrivateStore:
    """The private state of the workers hosted on one device, its swapping policy and its accounting."""

    def __init__(self, device: torch.device, budget: int | None = None, *, dedup: bool = True,
                 prefetch: bool = True, runtime: Runtime | None = None) -> None:
        self.device = device
        self.budget = budget
        self.prefetch = prefetch
        self.stats = SwapStats(budget=budget)
        if device.type == "cuda":
            from elasticd.agent.private.swap_cuda import CudaMover

            mover: Any = CudaMover(device)
        else:
            mover = CpuMover()
        self._copier = Copier(mover, self.stats, dedup, threaded=prefetch)
        self._pooled: bool = mover.pooled
        self._rt = weakref.ref(runtime) if runtime is not None else None
        self._workers: dict[int, _WorkerState] = {}
        self._owner: dict[int, int] = {}  # storage key -> rank
        # The plan: what is resident once every submitted swap has run. Only the switching thread reads it.
        self._plan_bytes = 0
        self._plan_pool: dict[int, int] = {}
        self._replicated = 0
        self._batch_ws: list[_WorkerState] = []  # workers whose restores are in the copier's open batch
        self._closed = False

    # -- registration -------------------------------------------------------------------------
    def register(self, rank: int, obj: T, worker: Worker | None = None) -> T:
        if not isinstance(obj, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer, dict, list, tuple)):
            raise TypeError(f"ctx.private takes a tensor, a list/dict of tensors, an nn.Module or an optimizer, "
                            f"not {type(obj).__name__}")
        shared = {t.untyped_storage()._cdata for t in self._replicated_tensors()}
        if any(t.untyped_storage()._cdata in shared for t in tensors_of(obj)):
            raise ValueError(f"ctx.private (logical rank {rank}): the object holds replicated state; "
                             f"state passed to ctx.replicate is shared by every worker and never swapped")
        ws = self._workers.get(rank)
        if ws is None:
            ws = self._workers[rank] = _WorkerState(rank, worker)
        ws.objs.append(obj)
        delta = self._scan(ws)
        if self.budget is not None and not self._closed:
            # Make room before accounting the new bytes: the registering worker runs now, others wait.
            self._measure_replicated()
            self._check_fits(ws)
            self._make_room(delta, {rank}, rank, must=True, evict_all=not ws.warm())
            self._trim_to_budget(delta + ws.growth() if ws.warm() else None)
            self._drain()
        self._plan_bytes += delta
        self._copier.account(resident=delta)
        log.debug("logical rank %d registered %d bytes of private state", rank, self.worker_bytes(rank))
        return obj

    def worker_bytes(self, rank: int) -> int:
        ws = self._workers.get(rank)
        return 0 if ws is None else ws.nbytes()

    # -- runtime hooks ------------------------------------------------------------------------
    def on_switch(self, out: Worker | None, inc: Worker) -> None:
        """Switch listener: runs before `inc` gets the baton; returns once its private state is usable."""
        if self.budget is None or self._closed or not self._workers:
            return
        if out is not None and out.rank in self._workers:
            ran = self._workers[out.rank]
            self._refresh(ran)
            ran.turns += 1
            ran.high = max(ran.high, ran.nbytes())
            self._check_fits(ran)
        self._measure_replicated()
        self._trim_to_budget()
        ws = self._workers.get(inc.rank)
        if ws is not None:
            self._bring_in(ws, {inc.rank}, inc.rank, must=True, reserve=ws.growth(), evict_all=not ws.warm())
            self._trim_to_budget(ws.growth() if ws.warm() else None)
            self._wait(ws)
        nxt = self._next_after(inc.rank)
        if self.prefetch and nxt is not None and nxt in self._workers and (ws is None or ws.warm()):
            target = self._workers[nxt]
            reserve = 0 if ws is None else ws.growth()
            if any(not s.planned for s in target.slots.values()) and \
                    self._bring_in(target, {inc.rank, nxt}, inc.rank, must=False, reserve=reserve):
                self._copier.account(prefetched=1)
        self._flush()

    def on_end(self) -> None:
        """End listener: the workers stopped; every slot goes back into the user's tensors. Idempotent."""
        if self._closed:  # listeners run one at a time: a worker's failure, then the end of run()
            return
        self._closed = True
        self._copier.close()  # runs whatever was planned: the device matches the plan again
        for ws in self._workers.values():
            for s in ws.slots.values():
                if not s.resident:
                    self._copier.restore_now(s)
        self._copier.release_pool()
        self._plan_pool.clear()
        if self._copier.error is not None:
            log.error("a private-state copy failed during the run: %s", self._copier.error)

    # -- synchronous API (benchmarks, tests) --------------------------------------------------
    def swap_out(self, rank: int) -> None:
        for s in self._workers[rank].slots.values():
            if s.planned:
                self._plan_out(s)
        self._drain()

    def swap_in(self, rank: int) -> None:
        ws = self._workers[rank]
        self._bring_in(ws, {rank}, rank, must=True)
        self._wait(ws)
        self._drain()

    # -- the plan -----------------------------------------------------------------------------
    def _bring_in(self, ws: _WorkerState, protect: set[int], ref: int, must: bool, reserve: int = 0,
                  evict_all: bool = False) -> bool:
        missing = [s for s in ws.slots.values() if not s.planned]
        if not missing and not must:
            return True
        need = sum(s.nbytes for s in missing) + reserve
        if not self._make_room(need, protect, ref, must, evict_all):
            return False
        for s in missing:
            self._plan_in(s, ws)
        return True

    def _make_room(self, extra: int, protect: set[int], ref: int, must: bool, evict_all: bool = False) -> bool:
        """Evict other workers' slots until `extra` more private bytes fit in the budget (or all of them)."""
        if self.budget is None:
            return True
        over = self._plan_bytes + self._replicated + extra - self.budget
        if over <= 0 and not evict_all:
            return True
        victims = self._victims(protect, ref)
        if not must and sum(s.nbytes for s in victims) < over:
            return False
        for s in victims:
            if over <= 0 and not evict_all:
                break
            self._plan_out(s)
            over -= s.nbytes
        if over > 0:
            self._copier.account(over_budget=1)
            log.warning("device %s: %d bytes over the --device-memory budget of %d bytes: private tensors of "
                        "pending collectives stay resident until the flush", self.device, over, self.budget)
        return True

    def _victims(self, protect: set[int], ref: int) -> list[Slot]:
        order = self._order()
        index = {r: i for i, r in enumerate(order)}

        def next_use(rank: int) -> int:  # how many turns until `rank` runs again, counted from `ref`
            if self._done(rank) or rank not in index:
                return len(order) + 1
            return (index[rank] - index.get(ref, 0)) % len(order)

        out: list[Slot] = []
        for ws in sorted((w for r, w in self._workers.items() if r not in protect),
                         key=lambda w: next_use(w.rank), reverse=True):
            pinned = self._pinned(ws)
            out += sorted((s for s in ws.slots.values() if s.planned and s.key not in pinned),
                          key=lambda s: s.nbytes, reverse=True)
        return out

    def _plan_out(self, s: Slot) -> None:
        s.planned = False
        self._plan_bytes -= s.nbytes
        if self._pooled:
            self._plan_pool[s.nbytes] = self._plan_pool.get(s.nbytes, 0) + 1
        self._copier.out(s)

    def _plan_in(self, s: Slot, ws: _WorkerState) -> None:
        if self._plan_pool.get(s.nbytes):
            self._plan_pool[s.nbytes] -= 1  # the mover makes the same choice: reuse a block of this size
        else:
            self._trim_to_budget(s.nbytes)
        s.planned = True
        self._plan_bytes += s.nbytes
        self._copier.into(s)
        if self._copier.threaded and ws not in self._batch_ws:
            self._batch_ws.append(ws)

    def _trim_to_budget(self, extra: int | None = 0) -> None:
        """Free pooled blocks (largest first) while they would push the device over the budget with `extra`
        more bytes; `extra=None`: free them all (room for growth nobody can foresee yet)."""
        if self.budget is None:
            return
        pool = sum(n * k for n, k in self._plan_pool.items())
        while pool and (extra is None or self._plan_bytes + self._replicated + pool + extra > self.budget):
            n = max(size for size, k in self._plan_pool.items() if k)
            self._plan_pool[n] -= 1
            pool -= n
            self._copier.trim(n)

    def _flush(self) -> None:
        f = self._copier.flush()
        if f is not None:
            for ws in self._batch_ws:
                ws.pending.append(f)
        self._batch_ws.clear()

    def _wait(self, ws: _WorkerState) -> None:
        """Return once `ws`'s planned restores are done (CPU) or ordered before its kernels (CUDA)."""
        self._flush()
        pending, ws.pending = ws.pending, []
        self._copier.wait(pending, ws.slots.values())

    def _drain(self) -> None:
        self._flush()
        self._copier.drain()

    # -- what the worker holds ----------------------------------------------------------------
    def _refresh(self, ws: _WorkerState) -> None:
        delta = self._scan(ws)
        self._plan_bytes += delta
        self._copier.account(resident=delta)

    def _scan(self, ws: _WorkerState) -> int:
        """Re-enumerate a resident worker's slots (grads appear and go, tensors get replaced); returns the
        change in bytes, not yet accounted."""
        found: dict[int, list[torch.Tensor]] = {}
        storages: dict[int, torch.UntypedStorage] = {}
        for t in tensors_of(ws.objs):
            if t.device != self.device or t.layout != torch.strided:
                continue  # host tensors need no swapping; sparse ones are left alone
            st = t.untyped_storage()
            if st.nbytes() == 0:
                continue
            found.setdefault(st._cdata, []).append(t)
            storages.setdefault(st._cdata, st)
        delta = 0
        slots: dict[int, Slot] = {}
        for key, ts in found.items():
            owner = self._owner.get(key)
            if owner is not None and owner != ws.rank:
                raise ValueError(f"ctx.private: logical rank {ws.rank} holds memory of logical rank {owner}'s "
                                 f"private state; private state must not be shared between workers")
            s = ws.slots.pop(key, None)
            if s is None:
                s = Slot(key, storages[key], ts)
                self._owner[key] = ws.rank
                delta += s.nbytes
            else:
                n = storages[key].nbytes()
                delta += n - s.nbytes
                s.nbytes, s.tensors = n, ts
            slots[key] = s
        for key, gone in ws.slots.items():
            del self._owner[key]
            delta -= gone.nbytes
        ws.slots = slots
        return delta

    def _check_fits(self, ws: _WorkerState) -> None:
        own = ws.nbytes()
        if self.budget is not None and own + self._replicated > self.budget:
            raise DeviceMemoryError(
                f"--device-memory {self.budget} bytes cannot hold logical rank {ws.rank}'s private state "
                f"({own} bytes) plus the replicated state ({self._replicated} bytes) on {self.device}")

    def _measure_replicated(self) -> None:
        seen: set[int] = set()
        total = 0
        for t in self._replicated_tensors():
            st = t.untyped_storage()
            if t.device == self.device and st._cdata not in seen:
                seen.add(st._cdata)
                total += st.nbytes()
        delta, self._replicated = total - self._replicated, total
        self._copier.account(replicated_bytes=delta)

    def _replicated_tensors(self) -> Iterable[torch.Tensor]:
        rt = self._runtime()
        for g in (rt.groups if rt is not None else []):
            yield from tensors_of(g.model)
            if g.optimizer is not None:
                yield from tensors_of(g.optimizer)

    def _pinned(self, ws: _WorkerState) -> set[int]:
        if ws.worker is None:
            return set()
        return {t.untyped_storage()._cdata for op, _ in ws.worker.turn.queued for t in _referenced(op)}

    def _runtime(self) -> Runtime | None:
        return self._rt() if self._rt is not None else None

    def _order(self) -> list[int]:
        rt = self._runtime()
        return list(rt.hosted) if rt is not None else sorted(self._workers)

    def _done(self, rank: int) -> bool:
        rt = self._runtime()
        return rt is not None and rt.baton.finished(rank)

    def _next_after(self, rank: int) -> int | None:
        order = self._order()
        if rank not in order:
            return None
        i = order.index(rank)
        for r in order[i + 1:] + order[:i]:
            if not self._done(r):
                return r
        return None


def attach(runtime: Runtime, budget: int | None = None, *, dedup: bool = True, prefetch: bool = True) -> PrivateStore:
    """The private-state store of `runtime`, created (with its switch and end listeners) on first use.

    `budget` is the device's `--device-memory` in bytes; None = the default policy (module docstring).
    """
    store: PrivateStore | None = runtime.private_store
    if store is not None:
        if budget is not None and budget != store.budget:
            raise RuntimeError(f"private state of this runtime already has a budget of {store.budget} bytes")
        return store
    if budget is None and runtime.device.type == "cuda":
        from elasticd.agent.private.swap_cuda import default_budget

        budget = default_budget(runtime.device)
    store = PrivateStore(runtime.device, budget, dedup=dedup, prefetch=prefetch, runtime=runtime)
    runtime.private_store = store
    runtime.switch_listeners.append(store.on_switch)
    runtime.end_listeners.append(store.on_end)
    log.info("private state on %s: budget %s", runtime.device, "none" if budget is None else f"{budget} bytes")
    return store

