"""The time-slicer: hosted logical workers as threads, one running at a time.

Each hosted logical rank runs the user's function in its own thread. A worker runs until it reaches a
collective (its own `ctx` collectives, or the end of a backward pass over replicated parameters); it
then queues the op, hands the baton to the next worker and sleeps on its own semaphore. When every
live worker waits at the same collective, the worker that arrived last flushes: one physical collective
over the M agents, results handed back, and the baton starts again at the lowest rank. The decisions
are `elasticd.agent.slicer.baton.Baton`'s; this module only executes them.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from elasticd.agent.capture import reentry_writes, shared_globals
from elasticd.agent.comm.collectives import Collective, CollectiveMismatch, FlushEnv, check_matching
from elasticd.agent.comm.p2p import PointToPoint
from elasticd.agent.comm.physical import PeerLost, PhysicalGroup
from elasticd.agent.compat import cuda_ranks, warning_origin, worker_env
from elasticd.agent.compat.torch_dist import install as install_torch_dist
from elasticd.agent.control.channel import ControlChannel, NullControl
from elasticd.agent.hints import add_hint
from elasticd.agent.process_exit import never_join
from elasticd.agent.replicated.buckets import BucketedFlush, bucket_bytes
from elasticd.agent.replicated.grad_sync import GradSync
from elasticd.agent.replicated.idioms import install as install_idioms
from elasticd.agent.replicated.ledger import ReplicatedStateError
from elasticd.agent.replicated.state import ReplicatedState
from elasticd.agent.resize.snapshot import AgentSnapshot
from elasticd.agent.slicer import rng
from elasticd.agent.slicer.backward_hook import install_backward_hook
from elasticd.agent.slicer.baton import AllDone, Baton, Flush, Idle, Run, Stranded, WorkerState
from elasticd.agent.slicer.boundary import (
    VOTE_NONE,
    VOTE_RESIZE,
    VOTE_STOP,
    Preempted,
    RunOutcome,
    StepBoundary,
)
from elasticd.agent.slicer.context import Work, WorkerContext
from elasticd.agent.slicer.device import enter_thread, finish_run, record_handover, wait_handover
from elasticd.agent.slicer.malloc import tune_malloc
from elasticd.agent.worker import Worker, current_worker, register_runtime, set_current_worker
from elasticd.core.errors import ElasticdInterrupt, JobError
from elasticd.core.layout import Layout, blocks_problem
from elasticd.core.timing import StepTiming
from elasticd.protocol.agents import AgentResize, AgentStop, RefusedInfo
from elasticd.protocol.nodes import bad_islands

log = logging.getLogger(__name__)


class WorkerFailed(JobError, RuntimeError):
    """A logical worker raised; carries its rank and formatted traceback to the launcher."""

    def __init__(self, rank: int, message: str, tb: str, peer_lost: bool = False) -> None:
        super().__init__(f"logical rank {rank} failed: {message}")
        self.rank = rank
        self.message = message
        self.traceback = tb
        self.peer_lost = peer_lost   # another agent died: not the user's error (comm/physical.py PeerLost)


class _Aborted(ElasticdInterrupt):
    """Unwinds a worker thread after another worker failed (BaseException: user `except Exception` can't eat it)."""


__all__ = ["VOTE_NONE", "VOTE_RESIZE", "VOTE_STOP", "Runtime", "WorkerFailed"]


class Runtime:
    def __init__(self, fn: Callable[[Any], Any], workers: int, hosted: list[int], phys: PhysicalGroup,
                 device: torch.device, deterministic: bool = False,
                 control: ControlChannel | None = None, restore: AgentSnapshot | None = None,
                 layout: Layout | None = None) -> None:
        self.fn = fn
        self.workers = workers
        self.hosted = list(hosted)
        self.phys = phys
        self.device = device
        self.deterministic = deterministic
        self.control: ControlChannel = control or NullControl(phys.rank)
        # `layout`: every agent's block of ranks (None: the uniform one); this agent's is `hosted`.
        self.env = FlushEnv(phys=phys, workers=workers, deterministic=deterministic, layout=layout,
                            islands=phys.islands.islands if phys.islands is not None else None)
        if layout is not None and layout.hosted(phys.rank) != self.hosted:
            raise ValueError(f"agent {phys.rank} hosts ranks {self.hosted}, not its block of layout {layout}")
        self.baton = Baton(self.hosted)
        self.p2p = PointToPoint(self)   # send/recv between logical ranks (agent/comm/p2p.py)
        # Compute vs physical-collective seconds per step, reported with each step (elasticd/core/timing.py).
        self.timing = StepTiming(len(self.hosted))
        self.current: Worker | None = None
        # ctx.replicate's groups and the once-per-step idioms over them (agent/replicated/state.py)
        self.replicated = ReplicatedState(self, restore.groups if restore is not None else [])
        self.groups = self.replicated.groups
        self._workers = {r: Worker(r, runtime=self) for r in self.hosted}
        if restore is not None:
            reentry_writes.watch()   # the function runs its first lines again: say which files they empty
            for r, w in self._workers.items():
                w.progress.restore = restore.workers[r]
                w.progress.start_step = w.progress.restore.step
        self.outcome = RunOutcome.RUNNING
        self.command: AgentResize | None = None  # the resize command this agent received, if any
        # Resizes refused already whose command is still to come (boundary.agree): the refusal is said again
        # under the command's epoch, for a daemon that made its plan after the agents refused at a held step.
        self.stale_resizes: list[RefusedInfo] = []
        self._done = threading.Event()
        self._failure: WorkerFailed | None = None
        self._aborted = False
        self._cuda = device if device.type == "cuda" else None
        # Reports, the resize vote, snapshots and what resumed workers load (agent/slicer/boundary.py).
        self.boundary = StepBoundary(self)
        self.env.vote = self.boundary.carried   # a gradient flush carries the next boundary's vote
        self.env.grad_buckets = BucketedFlush(phys, workers, self.env.vote, bucket_bytes())
        # Called as (outgoing, incoming) at every hand-over, before the incoming worker runs: where
        # private device state is swapped out and in. Outgoing is None at start.
        self.switch_listeners: list[Callable[[Worker | None, Worker], None]] = [self.replicated.swaps.on_switch]
        # Called when the workers stop: after the run, and when one fails before the others unwind through
        # user code (swapped-out private state must be back in the user's tensors by then). Idempotent.
        self.end_listeners: list[Callable[[], None]] = []
        # The ctx.private store (agent/private/registry.py `attach`), held by the runtime it belongs to:
        # a module-level map from runtime to store kept every finished segment alive, since the store
        # reaches its runtime through the workers it records.
        self.private_store: Any = None
        install_backward_hook()
        warning_origin.install()  # a warning torch raises through our wrappers names the user's line
        tune_malloc()  # before worker threads exist: see agent/slicer/malloc.py
        install_torch_dist(fn)  # torch.distributed / DDP inside workers address the logical world
        register_runtime(self)  # a backward pass on autograd's device thread is still its worker's
        worker_env.install()  # os.environ["RANK"], ["LOCAL_RANK"], ... per worker thread, as torchrun sets them
        if device.type == "cuda":
            cuda_ranks.install(device)  # set_device(local_rank), model.to(local_rank): the agent's GPU
        install_idioms(fn)  # clip_grad_norm_, GradScaler, schedulers on replicated state: once per step

    # -- lifecycle ----------------------------------------------------------------------------
    def run(self) -> dict[int, Any]:
        """Run every hosted worker to completion; returns their results by rank.

        Raises:
            WorkerFailed: a worker raised (every other hosted worker has been unwound).
        """
        # One object for every worker: a hand-over where no stream moved finds both workers' streams are
        # it and swaps nothing (rng.capture returns it unchanged; a worker that draws gets its own).
        initial = rng.capture(self._cuda)
        # Streams the user's code never seeded: under DDP each process draws numbers of its own from them
        # (an unseeded dropout mask, synthetic batch or shuffle), so each fresh worker gets its own here.
        # Seeded ones stay the process's: a seed set once per process gives every rank the same stream.
        unseeded = rng.unseeded()
        threads = []
        for r, w in self._workers.items():
            # A re-entered worker starts the function with the streams it started with the first time: the code
            # before ctx.steps runs again (a dataset drawn with torch.randn after a module-level seed) and must
            # compute what it computed then, as under DDP, where it ran once; ctx.steps then resumes the
            # streams where the step boundary left them.
            entry = w.progress.restore.extras.get("entry_rng") if w.progress.restore is not None else None
            if entry is not None:
                w.rng = rng.RngState.from_dict(entry)
            else:
                w.rng = rng.own_streams(initial, unseeded, self._cuda) if unseeded else initial
            w.progress.entry_rng = entry if entry is not None else w.rng.to_dict()
            w.ctx = WorkerContext(self, w)
            w.dist.env = worker_env.variables_for(r, self.workers)
            self.boundary.prepare(w)
            t = threading.Thread(target=self._body, args=(w,), name=f"elasticd-rank{r}", daemon=True)
            never_join(t)
            threads.append(t)
            t.start()
        self._execute(None, self.baton.start())
        self._done.wait()
        finish_run(self._cuda)  # the workers' kernels, on their own streams, are done before anything reads
        for end in self.end_listeners:
            end()
        if self._failure is not None:
            for t in threads:
                t.join(timeout=5.0)
            raise self._failure
        for t in threads:
            t.join()
        if self.outcome is RunOutcome.RUNNING:
            self.outcome = RunOutcome.DONE
        return {r: w.result for r, w in self._workers.items()}

    def _body(self, w: Worker) -> None:
        set_current_worker(w)
        # A thread the function starts takes its daemon flag from this one. Under DDP the function runs on a
        # main thread, so its threads are not daemon and the process waits for them at exit (an async
        # checkpoint writer). Changing the flag of a started thread changes only that inheritance: whether
        # shutdown waits for a thread was decided at its start (CPython 3.11-3.13), so it never waits for this one.
        threading.current_thread()._daemonic = False  # noqa: SLF001 - Thread.daemon refuses a started thread
        enter_thread(self._cuda)  # the current CUDA device is per thread: the main thread's does not carry over
        w.sem.acquire()
        if self._aborted:
            return
        wait_handover(self._cuda, w.turn.handover)
        try:
            shared_globals.refuse(self.fn)
            w.result = self.fn(w.ctx)
            if w.turn.queued:  # async collectives never waited on still complete, as in torch.distributed
                self.drain(w)
        except _Aborted:
            return
        except Preempted:
            pass  # the snapshot is taken; this worker leaves the baton like a returning one
        except BaseException as e:  # noqa: BLE001 - the user's error, reported with its rank
            self._fail(w.rank, e)
            return
        try:
            self._execute(w, self.baton.finish(w.rank))
        except _Aborted:
            return
        except BaseException as e:  # noqa: BLE001
            self._fail(w.rank, e)

    def _fail(self, rank: int, e: BaseException) -> None:
        if self._failure is None:
            add_hint(e)
            tb = "".join(traceback.format_exception(e))
            self._failure = WorkerFailed(rank, f"{type(e).__name__}: {e}", tb, peer_lost=isinstance(e, PeerLost))
            if not isinstance(e, PeerLost):   # a survivor's: the agent's report says so, not as a failure of its own
                log.error("logical rank %d failed on %s: %s", rank, socket.gethostname(), e)
        self._aborted = True
        for end in self.end_listeners:
            try:
                end()
            except Exception:  # noqa: BLE001 - the worker's failure is the one to report
                log.exception("end listener failed after logical rank %d failed", rank)
        for w in self._workers.values():
            try:
                w.sem.release()
            except RuntimeError:  # already released: that worker has a wake-up pending anyway
                pass
        self._done.set()

    # -- baton --------------------------------------------------------------------------------
    def _execute(self, me: Worker | None, action: Any) -> bool:
        """Carry out the baton's decisions; True if `me` still holds the baton afterwards.

        The answer must come from the action, not from `self.current`: once the baton is handed over,
        it may come back to `me` before `me` looks.
        """
        while True:
            if isinstance(action, Run):
                nxt = self._workers[action.rank]
                if nxt is me:
                    return True
                self._hand_over(me, nxt)
                return False
            if isinstance(action, Flush):
                self._flush(action.ranks)
                action = self.baton.flushed()
                continue
            if isinstance(action, AllDone):
                self.current = None
                self._done.set()
                return False
            if isinstance(action, Idle):
                ready = self.p2p.await_message(action.blocked, lambda: self._aborted)
                if ready < 0:
                    raise _Aborted()
                action = self.baton.resume(ready)
                continue
            if isinstance(action, Stranded):
                raise CollectiveMismatch(
                    f"logical ranks {list(action.returned)} returned from the function while ranks "
                    f"{list(action.waiting)} wait at their collective #{action.seq}: every rank must make "
                    f"the same collective calls"
                )
            raise AssertionError(f"unknown baton action {action!r}")

    def _hand_over(self, me: Worker | None, nxt: Worker) -> None:
        live = None
        if me is not None:
            me.rng = live = rng.capture(self._cuda, prev=me.rng)
        if nxt.rng is not live:   # else no stream moved: both workers' streams are the live ones
            rng.restore(nxt.rng, self._cuda, live=live)
        for listener in self.switch_listeners:
            listener(me, nxt)
        nxt.turn.handover = record_handover(self._cuda)  # nxt's stream waits on it, in nxt's thread
        self.current = nxt
        nxt.sem.release()

    def _wait_turn(self, w: Worker) -> None:
        w.sem.acquire()
        if self._aborted:
            raise _Aborted()
        wait_handover(self._cuda, w.turn.handover)

    def _flush(self, ranks: tuple[int, ...]) -> None:
        batches = [self._workers[r].turn.queued for r in ranks]
        lengths = {len(b) for b in batches}
        if len(lengths) != 1:
            raise CollectiveMismatch(
                f"logical ranks {ranks[0]} and {ranks[-1]} have different numbers of pending collectives "
                f"({len(batches[0])} vs {len(batches[-1])})"
            )
        started = time.perf_counter()
        for i in range(lengths.pop()):
            ops = [b[i][0] for b in batches]
            check_matching(ops)
            type(ops[0]).flush(ops, self.env)
            for b in batches:
                if b[i][1] is not None:
                    b[i][1]._complete()
        self.timing.add_flush(time.perf_counter() - started)
        for r in ranks:
            self._workers[r].turn.queued = []

    # -- called from worker threads -----------------------------------------------------------
    def current_rank(self) -> int:
        w = current_worker()
        if w is None:
            raise RuntimeError("elasticd: replicated state used outside a logical worker")
        return w.rank

    def enqueue(self, w: Worker, op: Collective, work: Work | None) -> None:
        if w.turn.once_running is not None:
            raise ReplicatedStateError(
                f"elasticd: a collective ({type(op).__name__}) inside {w.turn.once_running}, in logical rank {w.rank}: "
                f"elasticd runs that once per device for all the workers the device hosts, so the collective would "
                f"have one caller per device, not one per logical rank. An optimizer whose step communicates or "
                f"depends on its rank (a sharded Muon, ZeroRedundancyOptimizer) cannot be shared: leave it and "
                f"its model out of ctx.replicate and wrap the model in DistributedDataParallel inside the "
                f"function (each worker then owns its model and optimizer, as a DDP process does)")
        op.on_arrive(self.env)
        w.turn.queued.append((op, work))

    def drain(self, w: Worker | None) -> None:
        """Give up the baton until every hosted worker reaches this point and the queue is flushed."""
        if w is None or w is not current_worker():
            raise RuntimeError("elasticd: a collective handle was waited on outside its worker")
        if not self._execute(w, self.baton.arrive(w.rank)):
            self._wait_turn(w)
        w.turn.judged = False

    def block(self, w: Worker) -> None:
        """Give up the baton until `w`'s point-to-point message is there (agent/comm/p2p.py)."""
        if w is not current_worker():
            raise RuntimeError("elasticd: a receive was waited on outside its worker")
        if not self._execute(w, self.baton.block(w.rank)):
            self._wait_turn(w)
        w.turn.judged = False

    def before_backward(self, w: Worker) -> None:
        """A backward pass starts. If it is the last hosted worker's before a gradient flush (every other
        one waits at a GradSync, and nothing queued would be flushed before it), its gradients' buckets are
        reduced over the agents as they fill (replicated/buckets.py): every agent starts them in one order."""
        w.turn.backward_depth += 1
        if w.turn.backward_depth > 1:
            return   # reentrant: the outermost pass keeps the books
        self._arm_buckets(w)
        if not self.deterministic:
            for g in self.groups:
                g.before_backward(w.rank)

    def _arm_buckets(self, w: Worker) -> None:
        buckets = self.env.grad_buckets
        if (self.deterministic or self.phys.world == 1 or not self.groups or w.turn.no_sync_depth > 0 or w.turn.queued
                or buckets.armed):
            return
        for r in self.hosted:
            if r == w.rank:
                continue
            q = self._workers[r].turn.queued
            if self.baton.state[r] is not WorkerState.WAITING or not q or not isinstance(q[0][0], GradSync):
                return
        buckets.arm(self.groups)

    def after_backward(self, w: Worker) -> None:
        """The end of a backward pass: averaging gradients is a collective, so the worker yields here."""
        if not self._close_books(w) or w.turn.no_sync_depth > 0:
            return   # a reentrant pass ends inside the outer one, which is the switch point
        queued = len(w.turn.queued)
        if w.turn.touched_grads and self.groups:
            w.turn.touched_grads = False
            self.enqueue(w, GradSync(w.rank, groups=self.groups), None)
        elif self.env.grad_buckets.armed:
            self.env.grad_buckets.disarm()
        for hook in w.turn.backward_hooks:
            hook()
        if len(w.turn.queued) > queued:
            w.turn.judged = True   # the pass's accumulations are on the books, and no user code ran since
            self.drain(w)

    def backward_raised(self, w: Worker, error: BaseException) -> None:
        """A backward pass raised (the user may catch it and go on): what it accumulated is on the books."""
        if self._close_books(w) and self.env.grad_buckets.armed:
            self.env.grad_buckets.abandon(quiet=isinstance(error, ReplicatedStateError))

    def _close_books(self, w: Worker) -> bool:
        """A backward pass of `w` ended; True if it was the outermost one. Default mode: the gradients it
        accumulated into are recorded now (no per-parameter hooks ran, see ReplicatedGroup._hook)."""
        w.turn.backward_depth -= 1
        if w.turn.backward_depth > 0:
            return False
        if not self.deterministic:
            for g in self.groups:
                if g.after_backward(w.rank):
                    w.turn.touched_grads = True
        return True

    def backward_owner(self) -> Worker | None:
        """The running worker while it is inside a backward pass (None once the run ended or failed)."""
        w = self.current
        if w is None or self._aborted or self.outcome is not RunOutcome.RUNNING or w.turn.backward_depth <= 0:
            return None
        return w

    def _poll_control(self) -> int:
        vote = VOTE_NONE
        for cmd in self.control.poll():
            if isinstance(cmd, AgentStop):
                vote = VOTE_STOP
            elif isinstance(cmd, AgentResize):
                problem = blocks_problem(self.workers, cmd.world, cmd.blocks) or bad_islands(cmd.islands, cmd.world)
                if problem is not None:   # every agent gets the same command, so every agent refuses it
                    log.error("refusing resize %s to %d agents: %s", cmd.epoch, cmd.world, problem)
                    continue
                if self.stale_resizes:
                    refusal = dataclasses.replace(self.stale_resizes.pop(0), epoch=cmd.epoch)
                    log.info("dropping the command of resize %s, refused already", cmd.epoch)
                    self.control.refused(refusal)
                    continue
                self.command = cmd
                vote = max(vote, VOTE_RESIZE)
            else:   # a join is for a standby agent; one that runs a job has no use for it
                log.warning("ignoring control command %r while running", cmd)
        return vote

    def snapshot(self) -> AgentSnapshot:
        """After a preempted run: the replicated state once, and every hosted worker's own state."""
        return self.boundary.snapshot(self._workers)
