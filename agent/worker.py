"""A logical worker as every layer of the agent sees it, and which worker the calling thread is.

The runtime creates one `Worker` per hosted logical rank and runs it in its own thread; the layers
under the runtime (replicated state, the torch.distributed shims, private state, the backward hook)
only need to ask "which worker is this thread?", so that question lives here, below all of them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elasticd.agent.capture.carried import CarriedRestore
    from elasticd.agent.capture.loader import ResumableBatches
    from elasticd.agent.capture.loader_tracking import LoaderTracks
    from elasticd.agent.comm.collectives import Collective
    from elasticd.agent.resize.snapshot import WorkerSnapshot
    from elasticd.agent.runtime import Runtime
    from elasticd.agent.slicer.context import Work, WorkerContext
    from elasticd.agent.slicer.rng import RngState


def _held_lock() -> Any:
    lock = threading.Lock()
    lock.acquire()
    return lock


@dataclass(eq=False, slots=True)
class TurnState:
    """Where a worker stands in the time-slicer's turn: collectives it queued, backward passes it runs, and
    what the runtime last judged of its changes to replicated state (agent/runtime.py, replicated/)."""

    queued: list[tuple[Collective, Work | None]] = field(default_factory=list)
    touched_grads: bool = False
    backward_depth: int = 0  # backward passes running in this thread (reentrant checkpointing nests them)
    no_sync_depth: int = 0
    # No user code ran since the runtime last judged this worker's changes to replicated state (set at the end
    # of a backward pass, whose accumulations the runtime has just recorded; cleared when the worker runs on).
    judged: bool = False
    once_running: str | None = None  # inside an operation run once per device for all hosted workers (replicated/once.py)
    replicate_calls: int = 0
    # Called after each backward pass outside no_sync; may queue collectives (e.g. a DDP-wrapped
    # private model's gradient average), which the runtime then flushes with the replicated ones.
    backward_hooks: list[Callable[[], None]] = field(default_factory=list)
    handover: Any = None  # CUDA: the event the previous worker recorded when it handed over (slicer/device.py)


@dataclass(eq=False, slots=True)
class Progress:
    """A worker's steps and what its step boundary saves and restores (agent/slicer/boundary.py)."""

    start_step: int = 0
    total_steps: int | None = None  # from ctx.steps(total): lets `submit --wait` draw a progress bar
    metrics: dict[str, Any] = field(default_factory=dict)
    loaders: list[ResumableBatches] = field(default_factory=list)
    private: list[Any] = field(default_factory=list)  # ctx.private registrations, in order
    restore: WorkerSnapshot | None = None   # resuming after a resize: where this rank was
    snapshot: WorkerSnapshot | None = None  # taken at the boundary where the agents stopped
    # The worker's random streams when it first entered the function (rng.RngState.to_dict()), carried across
    # re-entry: the code before ctx.steps runs again after a resize and must draw what it drew the first time.
    entry_rng: dict[str, Any] | None = None


@dataclass(eq=False, slots=True)
class CaptureState:
    """What the worker's function built that nobody registered, carried across re-entry (agent/capture/)."""

    # Optimizers, LR schedulers, GradScalers and model averages/copies this worker's thread built, in creation
    # order, and the ids of those ctx.replicate / ctx.private carry themselves (agent/capture/carried.py).
    created: list[Any] = field(default_factory=list)
    registered: set[int] = field(default_factory=set)
    carried_restore: CarriedRestore | None = None  # resuming: their saved states, until the first boundary
    constructing: int = 0   # inside such an object's constructor: the copies it makes are part of it
    loader_tracks: LoaderTracks | None = None      # plain DataLoader iterators (agent/capture/loader_tracking.py)
    entered_steps: bool = False                    # ctx.steps has started in this run of the function
    loop_start: Any = None   # the function's plain local values when ctx.steps began (capture/function_locals.py)


@dataclass(eq=False, slots=True)
class DistState:
    """torchrun plumbing for one worker (agent/compat/): its RANK, LOCAL_RANK, ... as os.environ shows them in
    its thread; whether its init_process_group ran (None: an @elastic function's world, there from the start)
    and the backend it named; its subgroups; the singletons a launcher keeps once per process."""

    env: dict[str, str | None] | None = None
    initialized: bool | None = None
    backend: str | None = None
    groups_made: int = 0   # torch.distributed.new_group calls so far: the next one's channel (compat/dist_groups.py)
    singletons: dict[Any, Any] = field(default_factory=dict)   # compat/per_rank_singletons.py
    main_module: Any = None   # torchrun mode: the script's module this worker runs, its `__main__` (compat/per_rank_main.py)


@dataclass(eq=False, slots=True, weakref_slot=True)
class Worker:
    """One logical worker: its thread's identity and turn, and one record per concern that reads and writes it."""

    rank: int
    # A held lock used as a binary semaphore: released once per hand-over to this worker, acquired by
    # the worker to wait for it. The C lock wakes in a fraction of threading.Semaphore's time.
    sem: Any = field(default_factory=_held_lock)
    ctx: WorkerContext | None = None
    runtime: Runtime | None = None   # the runtime that hosts this worker (set when it is made)
    rng: RngState | None = None
    result: Any = None
    turn: TurnState = field(default_factory=TurnState)
    progress: Progress = field(default_factory=Progress)
    capture: CaptureState = field(default_factory=CaptureState)
    dist: DistState = field(default_factory=DistState)


_tls = threading.local()


def set_current_worker(w: Worker) -> None:
    """Called once by the worker's own thread, before it runs the user's function."""
    _tls.worker = w


def current_worker() -> Worker | None:
    """The worker whose thread this is (None outside worker threads)."""
    return getattr(_tls, "worker", None)


_runtimes: weakref.WeakSet[Any] = weakref.WeakSet()   # this process's runtimes (agent/runtime.py)


def register_runtime(runtime: Any) -> None:
    _runtimes.add(runtime)


def worker_in_backward() -> Worker | None:
    """The worker that holds the baton of a runtime in this process while it runs a backward pass. Autograd
    runs the backward pass of CUDA tensors on a device thread of its own: code called from there (a hook,
    an autograd.Function's backward) has no current worker, and belongs to this one."""
    for rt in list(_runtimes):
        w = rt.backward_owner()
        if w is not None:
            return w
    return None
