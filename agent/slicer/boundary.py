"""The step boundary: progress reports, the resize/stop vote, and a worker's snapshot and restore.

At every boundary of `ctx.steps` the agent's first hosted worker reports the step and the agents agree
on a vote (max of the agents' requests), so every agent stops at the same step without a coordinator
choosing it. When the last whole-group collective before the boundary was a gradient flush (a step
with a backward pass and nothing collective after it), the vote already travelled inside that flush,
cast when the flush began (comm/carried_vote.py); otherwise the boundary votes with a 2-element
all-reduce (max) of its own. Either way every agent decides at the same point of the collective
sequence. Steps the launcher scheduled a resize after (`--scale-at`, passed down as `hold_at`) are
voted for by every agent, so the resize happens exactly there and not one step later when the command
arrives late. Where the agents stop, each worker saves what it needs to continue (next step, RNG streams,
loader positions, metrics, `ctx.private` objects, and what it never registered: optimizers, schedulers,
GradScalers and plain DataLoader iterators), and a resumed worker gets all of it back at the start of
`ctx.steps`. The runtime composes one `StepBoundary`; the decisions of the baton stay in the runtime.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from elasticd import protocol as p
from elasticd.agent.capture import carried, function_locals, loader_tracking
from elasticd.agent.capture.loader import ResumableBatches
from elasticd.agent.comm import beat
from elasticd.agent.comm.carried_vote import CarriedVote
from elasticd.agent.comm.collectives import Collective, FlushEnv
from elasticd.agent.private import saving
from elasticd.agent.resize.periodic import FLAG_BUSY, FLAG_DUE, FLAG_NONE, PeriodicSnapshots
from elasticd.agent.resize.snapshot import AgentSnapshot, WorkerSnapshot
from elasticd.agent.slicer import rng
from elasticd.agent.worker import Worker
from elasticd.core.errors import ElasticdInterrupt, JobError
from elasticd.core.timing import STALL_METRIC

if TYPE_CHECKING:
    from elasticd.agent.runtime import Runtime

log = logging.getLogger(__name__)

# What the agents vote at each step boundary; the maximum wins, so a stop beats a resize.
VOTE_NONE, VOTE_RESIZE, VOTE_STOP = 0, 1, 2
_MESSAGE_BYTES = 4096   # a refused resize's reason, as every agent reports it


class RunOutcome(str, Enum):
    """How a runtime's run of the function ends."""

    RUNNING = "running"
    DONE = "done"        # every hosted worker returned
    RESIZE = "resize"    # unwound at the step boundary the agents agreed to resize at
    STOP = "stop"        # unwound at the step boundary the agents agreed to stop at


class StepsAgain(JobError, RuntimeError):
    """The function started `ctx.steps` again in one run: its steps cannot be numbered across a resize."""


class Preempted(ElasticdInterrupt):
    """Unwinds a worker at the step boundary where the agents agreed to resize or stop."""


@dataclass(slots=True)
class SnapshotPoint(Collective):
    """Every hosted worker waits here once it has copied its state for a periodic snapshot; the last one to
    arrive adds the replicated state. Nothing of the next step has run on any worker by then (a forward pass
    may update replicated buffers), so the snapshot is the state between two steps, as a resize's is."""

    op: ClassVar[str] = "periodic_snapshot"
    boundary: StepBoundary | None = None
    step: int = 0

    def signature(self) -> tuple:
        return (self.op, self.step)

    @classmethod
    def flush(cls, ops: list[Collective], env: FlushEnv) -> None:
        first = ops[0]
        assert isinstance(first, SnapshotPoint) and first.boundary is not None
        first.boundary.submit_periodic(first.step)


@dataclass(slots=True)
class CapturePoint(Collective):
    """Every hosted worker waits here once it has tried to copy its state for a resize; the last one to
    arrive asks every agent whether all of their workers could (`StepBoundary.agree`). A worker whose
    state cannot be carried (carried.NotCarried: a state_dict() that raises, a tensor too big to copy)
    must not cost the job: the agents then refuse the resize together and every worker trains on."""

    op: ClassVar[str] = "resize_capture"
    boundary: StepBoundary | None = None
    step: int = 0
    problem: str = ""   # why this worker's state could not be captured ("" if it was)

    def signature(self) -> tuple:
        return (self.op, self.step)

    @classmethod
    def flush(cls, ops: list[Collective], env: FlushEnv) -> None:
        first = ops[0]
        assert isinstance(first, CapturePoint) and first.boundary is not None
        problem = next((op.problem for op in ops if isinstance(op, CapturePoint) and op.problem), "")
        first.boundary.agree(first.step, problem)


class StepBoundary:
    def __init__(self, runtime: Runtime, hold_at: frozenset[int] = frozenset()) -> None:
        self.rt = runtime
        self.hold_at = hold_at          # steps after which a scheduled resize happens (`--scale-at`)
        # [resize/stop vote, periodic snapshot flag]: one all-reduce (max) per step carries both.
        self._vote = torch.zeros(2, dtype=torch.int64)
        # ... or the same two values carried by the step's gradient flush, cast by `_cast`.
        self.carried = CarriedVote(levels=(VOTE_STOP, FLAG_BUSY))
        self.carried.cast = self._cast
        self._running: int | None = None    # the step the hosted workers are in (None before ctx.steps)
        self._polled = VOTE_NONE            # control commands read for a carried vote not yet decided
        self._stop_at: int | None = None
        self.periodic: PeriodicSnapshots | None = None   # set by the agent process (it outlives runtimes)
        self._snap_at: int | None = None
        self.resumed_from: int | None = None   # restarted after a failure: the step it resumed at (reported)
        self._resumed_at: float | None = None   # when its first step after that completed (wall clock)
        # Re-formed by a resize: when this agent completed its last step before it (monotonic), and once
        # a step completed after it, the pause between the two (reported with every step from then on: a
        # throttled report may be merged into the next, and the supervisor takes it once).
        self.stall_from: float | None = None
        self._stall_s: float | None = None
        self._step_times: list[float] = []
        carried.install()
        loader_tracking.install()

    def prepare(self, w: Worker) -> None:
        """Before the worker's thread runs the function: what a resumed worker's objects load from."""
        w.capture.loader_tracks = tracks = loader_tracking.LoaderTracks()
        w.turn.backward_hooks.append(tracks.after_backward)
        if w.progress.restore is not None:
            w.capture.loader_tracks.saved = w.progress.restore.extras.get("raw_loaders", [])
            w.capture.carried_restore = carried.CarriedRestore(w.rank, w.progress.restore.extras.get("carried", []))

    # -- registration (called from worker threads) --------------------------------------------
    def begin_steps(self, w: Worker) -> None:
        """First step of `ctx.steps` after a resize: the worker's streams and objects continue where they were.

        Raises:
            StepsAgain: the function started a second `ctx.steps` loop in this run.
        """
        if w.capture.entered_steps:
            # Its steps count from where the job resumes, over the whole function: a re-entered function's
            # second loop would start at the resumed step too, and skip the steps before it (exit 0).
            raise StepsAgain(
                "elasticd: ctx.steps was started a second time in one run of the function (a loop over epochs "
                "around it, or a second phase after the first). Its steps count over the whole job: after a "
                "resize or a recovery the function is entered again at the step the job reached, so a second "
                "loop would start there as well and skip every step of it before that one. Write one loop over "
                "every step: `for step in ctx.steps(epochs * steps_per_epoch):` with `epoch = step // "
                "steps_per_epoch` (ctx.batches goes on from epoch to epoch by itself), or for phases `for step "
                "in ctx.steps(warmup + main):` with `if step == warmup:` where the second phase begins")
        w.capture.entered_steps = True
        if w.rank == self.rt.hosted[0]:
            self._running = w.progress.start_step
        if w.capture.loader_tracks is not None:
            w.capture.loader_tracks.new_step()
        if w.progress.restore is not None:
            rng.restore(rng.RngState.from_dict(w.progress.restore.rng), self.rt._cuda)
            w.progress.metrics.update(w.progress.restore.metrics)
        if w.capture.carried_restore is not None:
            w.capture.carried_restore.begin_steps(w)
        w.capture.loop_start = function_locals.begin(
            self._thread_entry, w.progress.restore.extras.get("function_locals") if w.progress.restore is not None else None)

    @property
    def _thread_entry(self) -> Any:
        """Where a worker's thread enters the runtime: the frames above it are the function's (function_locals)."""
        return type(self.rt)._body.__code__

    def restore_private(self, w: Worker, obj: Any) -> None:
        carried.mark_registered(w, obj)
        k = len(w.progress.private)
        w.progress.private.append(obj)
        saved = w.progress.restore.extras.get("private", []) if w.progress.restore is not None else []
        if k < len(saved):
            saving.load(obj, saved[k])

    def attach_loader(self, w: Worker, it: ResumableBatches) -> None:
        k = len(w.progress.loaders)
        w.progress.loaders.append(it)
        if w.capture.loader_tracks is not None:
            w.capture.loader_tracks.skip.add(id(it.loader))
        if w.progress.restore is not None and k < len(w.progress.restore.loaders):
            it.load_state_dict(w.progress.restore.loaders[k])

    # -- the boundary ---------------------------------------------------------------------------
    def step_boundary(self, w: Worker, step: int) -> None:
        if w.capture.carried_restore is not None:
            # One step ran after resuming: every saved object must have found its new self by now.
            w.capture.carried_restore.check_complete()
            w.capture.carried_restore = None
        if w.rank == self.rt.hosted[0]:
            # The first hosted worker speaks for the agent: report, then vote. Its boundary is at the
            # same point of the collective sequence on every agent, so the vote cannot cross another
            # physical collective.
            self._report(w, step)
            agreed = self.carried.take(step, self.rt.phys.collectives)
            if agreed is None:
                self._vote[:] = torch.tensor(self._ballot(step, w.progress.total_steps))
                # A physical collective: an agent waits here for slower ones, so it counts as flush time.
                voting = time.perf_counter()
                self.rt.phys.all_reduce_(self._vote, "max")
                self.rt.timing.add_flush(time.perf_counter() - voting)
                agreed = tuple(int(v) for v in self._vote.tolist())
            self._polled = VOTE_NONE   # every command read so far is in `agreed`
            self._running = step + 1
            vote, flag = agreed
            periodic = self.periodic
            if periodic is not None:
                periodic.voted(flag)
            if vote != VOTE_NONE:
                self._stop_at = step
                self.rt.outcome = RunOutcome.STOP if vote == VOTE_STOP else RunOutcome.RESIZE
            elif flag == FLAG_DUE and periodic is not None:
                # (An agent without snapshots -- e.g. a joiner started without the job's interval -- votes
                # none and writes nothing: that snapshot stays incomplete and is never restored.)
                self._snap_at = step
        if self._stop_at == step and self.rt.outcome is RunOutcome.RESIZE:
            self._capture_for_resize(w, step)   # a stop keeps nothing: its agents just exit
        if self._stop_at == step:
            raise Preempted()
        if self._snap_at == step:
            self._capture_periodic(w, step)
        if w.capture.loader_tracks is not None:
            w.capture.loader_tracks.new_step()

    def _ballot(self, step: int, total: int | None) -> tuple[int, int]:
        """This agent's (resize/stop vote, periodic-snapshot flag) for the boundary after `step`."""
        self._polled = max(self._polled, self.rt._poll_control())
        vote = max(self._polled, VOTE_RESIZE) if step in self.hold_at else self._polled
        periodic = self.periodic
        return vote, periodic.flag(step, total) if periodic is not None else FLAG_NONE

    def _cast(self) -> tuple[int, tuple[int, int]] | None:
        """At a gradient flush (in the flushing worker's thread; the baton makes it the only one running):
        the vote for the boundary that ends the step in progress. A command read here and not decided by
        this flush's vote (another collective came after it) stays in `_polled` for the next vote."""
        step = self._running
        if step is None:
            return None
        return step, self._ballot(step, self.rt._workers[self.rt.hosted[0]].progress.total_steps)

    def _capture(self, w: Worker, step: int) -> WorkerSnapshot:
        """Everything of `w` a resumed worker needs, in host memory (private and carried state copied).

        Raises:
            carried.NotCarried: a point-to-point message of `w`'s is in flight (agent/comm/p2p.py).
        """
        in_flight = self.rt.p2p.in_flight(w.rank)
        if in_flight is not None:
            raise carried.NotCarried(in_flight)
        return WorkerSnapshot(
            rank=w.rank, step=step + 1, rng=rng.capture(self.rt._cuda).to_dict(),
            loaders=[it.state_dict() for it in w.progress.loaders], metrics=dict(w.progress.metrics),
            extras={"private": [saving.save(obj) for obj in w.progress.private],
                    "carried": carried.save(w),
                    "function_locals": function_locals.save(self._thread_entry, w.capture.loop_start),
                    "raw_loaders": w.capture.loader_tracks.save() if w.capture.loader_tracks is not None else [],
                    "entry_rng": w.progress.entry_rng,
                    **self.rt.replicated.worker_extras(w)},
        )

    def _capture_for_resize(self, w: Worker, step: int) -> None:
        """Copy `w`'s state, then wait until every hosted worker did and the agents agreed that all could.
        On return `_stop_at` still names `step` (raise Preempted) or is None: the resize was refused and
        `w` trains on, its copy dropped."""
        problem = ""
        try:
            w.progress.snapshot = self._capture(w, step)
        except Exception as e:  # noqa: BLE001 - any state that cannot be copied refuses the resize
            problem = f"logical rank {w.rank}: " + (str(e) if isinstance(e, carried.NotCarried)
                                                     else f"{type(e).__name__}: {e}")
        self.rt.enqueue(w, CapturePoint(w.rank, boundary=self, step=step + 1, problem=problem), None)
        self.rt.drain(w)
        if self._stop_at is None:
            w.progress.snapshot = None

    def agree(self, step: int, problem: str) -> None:
        """The last hosted worker's capture is done: one all-reduce tells every agent whether any worker
        anywhere could not be captured; if one could not, its agent's message is broadcast and the resize
        is refused on every agent alike (the step's collectives are over, so this one is the next on all)."""
        phys = self.rt.phys
        flag = torch.tensor([phys.world - phys.rank if problem else 0], dtype=torch.int64)
        phys.all_reduce_(flag, "max")   # the lowest agent with a problem speaks for all
        if int(flag) == 0:
            return
        by = phys.world - int(flag)
        text = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
        if phys.rank == by:
            raw = problem.encode()[:_MESSAGE_BYTES]
            text[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        phys.broadcast_(text, by)
        message = bytes(text.tolist()).rstrip(b"\0").decode(errors="replace")
        epoch = self.rt.command.epoch if self.rt.command is not None else None
        refusal = p.RefusedInfo(epoch=epoch, step=step - 1, message=message, by=by)
        if epoch is None:
            # Another agent's command (or a step held for a --scale-at entry) made the vote before this agent's
            # own copy of the command came: the copy still on its way is this resize's, and must not start it
            # again at the next boundary.
            self.rt.stale_resizes.append(refusal)
        # Training goes on as if nobody had asked: no stop, no held step, no command waiting to be voted.
        self._stop_at = None
        self.rt.outcome = RunOutcome.RUNNING
        self.rt.command = None
        self._polled = VOTE_NONE
        self.hold_at = frozenset()   # `elasticd run` drops the rest of its --scale-at schedule too
        log.info("resize refused after step %d: %s", step - 1, message)
        self.rt.control.refused(refusal)

    def _capture_periodic(self, w: Worker, step: int) -> None:
        periodic = self.periodic
        assert periodic is not None
        try:
            part = self._capture(w, step).to_dict()
            part["metrics"] = saving.clone_state(part["metrics"])
            periodic.add_worker(w.rank, part)
        except Exception as e:  # noqa: BLE001 - training goes on without snapshots; the reports say why
            periodic.fail(f"logical rank {w.rank}'s state at step {step} cannot be snapshotted: "
                          f"{type(e).__name__}: {e}")
        # Every hosted worker waits here, whatever happened: the others' queues must match.
        self.rt.enqueue(w, SnapshotPoint(w.rank, boundary=self, step=step + 1), None)
        self.rt.drain(w)

    def submit_periodic(self, step: int) -> None:
        """The last hosted worker arrived: add the replicated state and hand the snapshot to the writer."""
        periodic = self.periodic
        assert periodic is not None
        self._snap_at = None
        clone = saving.clone_state
        groups = [g.snapshot().mapped(clone).to_dict() for g in self.rt.groups]
        periodic.submit(step, {"groups": groups})

    @property
    def last_step_at(self) -> float | None:
        """When this agent last completed a step (monotonic), None before its first."""
        return self._step_times[-1] if self._step_times else None

    @property
    def stopped_at(self) -> int | None:
        """The step after which the agents stopped (resize or stop), None while running."""
        return self._stop_at

    def _report(self, w: Worker, step: int) -> None:
        # Before anything else of the boundary: the step's compute ends here on every agent alike.
        self.rt.timing.boundary(time.perf_counter())
        now = time.monotonic()
        self._step_times.append(now)
        del self._step_times[:-20]
        metrics: dict[str, Any] = {}
        if self.periodic is not None:
            metrics.update(self.periodic.info())
        if self.stall_from is not None:
            self._stall_s, self.stall_from = round(now - self.stall_from, 3), None
        if self._stall_s is not None:
            metrics[STALL_METRIC] = self._stall_s
        if self.resumed_from is not None:
            metrics["resumed_from"] = self.resumed_from
            # By this agent's clock: the supervisor hears of it up to a throttled report and a heartbeat later.
            self._resumed_at = self._resumed_at or time.time()
            metrics["resumed_at"] = round(self._resumed_at, 3)
        if w.progress.total_steps is not None:
            metrics["total_steps"] = w.progress.total_steps
        if len(self._step_times) > 1:
            metrics["steps_per_s"] = (len(self._step_times) - 1) / (now - self._step_times[0])
        # The runtime's own entries first: the report keeps only the first MAX_METRICS (protocol/limits.py).
        metrics.update((k, v) for k, v in w.progress.metrics.items() if k not in metrics)
        beat.stepped(step)
        self.rt.control.step(step, metrics, self.rt.timing.take(), held=step in self.hold_at)

    def snapshot(self, workers: dict[int, Worker]) -> AgentSnapshot:
        """After a preempted run: the replicated state once, and every hosted worker's own state."""
        # In host memory: the next segment's model is built on the device while this is still referenced.
        host = saving.host_view
        groups = [g.snapshot().mapped(host) for g in self.rt.groups]
        missing = [r for r, w in workers.items() if w.progress.snapshot is None]
        if missing:
            raise RuntimeError(f"logical ranks {missing} left the function without reaching the step boundary "
                               f"where the job stopped; every rank must run the same ctx.steps loop")
        return AgentSnapshot(groups=groups, workers={r: w.progress.snapshot for r, w in workers.items()})
