"""One live resize, decided in one place: who moves, when to go, when it is done, when to roll back, and
whether the snapshot to fall back to is whole.

The island scheduler (`elasticd.scheduler.resizing`) resizes a running job from M to M2 agents (layout
epoch E) across its nodes, `elasticd run`'s too (its node runs in the run's process, elasticd.local_node).
The decisions live here, in `ResizePlan`: a synchronous state machine with no sockets, threads, processes or clock (`now` is passed in). The shells feed it
events and execute the actions it returns (`Go`, `Done`, `Abort`, `Refuse`, `RollBack`, `FallBack`,
`Fail`).

A resize may also keep M and change the block sizes (a live re-layout, speed-aware placement): every
agent stays, nobody joins or leaves, and ranks move between them. `blocks`/`src_blocks` are the new and
old layouts in wire form (elasticd.core.layout `Layout.wire()`: empty = uniform); a fall-back
restarts on `src`, `src_blocks`.

Who moves: ranks 0..min(M, M2)-1 stay (their agents keep their process), a grow adds joining ranks
M..M2-1, a shrink lets ranks M2..M-1 leave. A shrink may instead keep any subset of the old ranks
(`keep`, in new rank order: a drain keeps the agents off the node going away), which renumbers them;
the new group's rank 0, whose node picks the rendezvous port, is then old rank `keep[0]`. Phases:

``prepare``  the joiners start as warm standbys and the new group's rendezvous port is chosen, while the
             job keeps training at M. `Go` once the port is known and every joiner is ready; a joiner
             that dies, or a deadline passed, gives `Abort`: nothing was touched, the job goes on at M.
             A scheduled grow may be prepared ahead of its step (`after_step`): its joiners warm up while
             the job trains towards the step, and the go waits until the job is reported there (`reached`),
             where its agents hold; the request counts from then, as for a resize asked for at that step.
``go``       every agent was told; it is `Done` when rank 0 completed a step at the new size with every
             rank of the new layout having reported its part. An agent dying, or the deadline passing,
             gives `RollBack`: the shell stops every agent, whatever it is doing.
``refused``  the agents could not carry some state across (agent/slicer/boundary.py `CapturePoint`) and
             agreed to train on at M before anything moved: `Refuse`, the joiners go, the leavers stay.
``rollback`` the shell reports the places (nodes; the launcher's one machine) whose agents are all gone;
             once none is left, `FallBack` if the parts the agents saved at the step boundary
             (elasticd.core.parts) cover every logical rank and the replicated state, else
             `Fail` naming what is missing. A deadline passing here is a `Fail` too.

The plan is also the record the scheduler persists with the job (`Job.resize`): every field is plain
data, so a restarted scheduler resumes the same decisions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from elasticd.core import parts
from elasticd.core.lifecycle import ResizePhase

NO_DEADLINE = math.inf   # a plan's timeout_s for a shell that waits as long as it takes (`elasticd run`)

# --- actions ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Go:
    """Tell every agent of the old and the new layout to re-form at the port now (joiners: join)."""


@dataclass(frozen=True, slots=True)
class Done:
    """The new layout trains: `seconds` from the request to rank 0's first step at the new size."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Abort:
    """Call the resize off before anything moved: stop the joiners; the job goes on at its old size."""

    reason: str


@dataclass(frozen=True, slots=True)
class Refuse:
    """The agents found at the step boundary a state they cannot carry and train on at the old size, nothing
    moved: send the joiners away, take back the leavers; the job keeps its old layout. `reason` is theirs."""

    reason: str


@dataclass(frozen=True, slots=True)
class RollBack:
    """The hand-over failed half-way: stop every agent of the job at once, then report each place gone."""

    error: dict[str, Any]   # the failure, naming the resize


@dataclass(frozen=True, slots=True)
class FallBack:
    """Every agent is gone and the snapshot is whole: restart on the old layout from this epoch's parts."""


@dataclass(frozen=True, slots=True)
class Fail:
    """No way back: the job fails with `error` (the original failure, and why it cannot fall back)."""

    reason: str
    error: dict[str, Any]


Action = Go | Done | Abort | Refuse | RollBack | FallBack | Fail


@dataclass(slots=True)
class ResizePlan:
    """A live resize in flight, and the decisions about it (see the module docstring)."""

    epoch: int
    src: int                       # devices before
    dst: int                       # devices after
    why: str
    requested_at: float
    placement: list[list[str]]     # the whole new layout, rank -> [place (node), device]
    deadline: float                # for the current phase
    phase: ResizePhase = ResizePhase.PREPARE
    step: int = 0                  # job step when requested; then the step the agents stopped after
    port: int = 0
    ready: list[int] = field(default_factory=list)   # joining ranks warm (said hello)
    acked: list[int] = field(default_factory=list)   # new-layout ranks that finished the re-formation
    commanded_at: float | None = None
    handover_s: float | None = None                 # rank 0's own time from its vote to the new group
    stall_s: float | None = None                    # rank 0's own time from its last old step to its first new one
    failure: dict[str, Any] | None = None          # rollback: what went wrong
    gone: list[str] = field(default_factory=list)   # rollback: places whose agents of the job all exited
    saved: dict[str, list[int]] = field(default_factory=dict)   # place -> snapshot parts it holds (-1: replicated)
    timeout_s: float = 120.0       # per phase; math.inf: no deadline (`elasticd run` waits as long as it takes)
    keep: list[int] = field(default_factory=list)   # a shrink keeping these old ranks, in new rank order
    blocks: list[int] = field(default_factory=list)      # the new layout's block sizes (empty: uniform)
    src_blocks: list[int] = field(default_factory=list)  # the old layout's, to fall back to (empty: uniform)
    release: bool = False          # to the layout the job has: lets agents held at a step go on (no state moves)
    after_step: int = -1           # prepared ahead: the go waits for the job at this step (-1: none, or there)

    def __post_init__(self) -> None:
        self.phase = ResizePhase(self.phase)   # a plan read back from the job table holds its phase as text

    @classmethod
    def begin(cls, *, epoch: int, src: int, dst: int, why: str, now: float, placement: list[list[str]],
              step: int, timeout_s: float, keep: list[int] | None = None, blocks: list[int] | None = None,
              src_blocks: list[int] | None = None, release: bool = False, after_step: int = -1) -> ResizePlan:
        """A resize from `src` to `dst` agents whose new layout is `placement` (ranks 0..src-1 as before,
        or for a shrink, the old ranks `keep` as new ranks 0..dst-1), with block sizes `blocks` (from
        `src_blocks`; both in wire form, empty = uniform). `dst == src` is a re-layout: the sizes must differ.
        `after_step` >= 0: a scheduled resize prepared ahead of that step (module docstring).

        Raises:
            ValueError: sizes, blocks or `keep` that describe no resize.
        """
        blocks, src_blocks = list(blocks or []), list(src_blocks or [])
        if dst < 1 or len(placement) != dst or (dst == src and blocks == src_blocks and not release):
            raise ValueError(f"no resize from {src} to {dst} devices over a layout of {len(placement)}"
                             + (f" with blocks {blocks or 'uniform'}" if dst == src else ""))
        if blocks and len(blocks) != dst or src_blocks and len(src_blocks) != src:
            raise ValueError(f"blocks {blocks} / {src_blocks} do not match {dst} / {src} devices")
        if dst == src and keep is not None and list(keep) != list(range(dst)):
            raise ValueError(f"a re-layout of {src} devices keeps every agent in place, not {keep}")
        if keep is not None and (len(keep) != dst or dst > src or len(set(keep)) != dst
                                 or not all(0 <= k < src for k in keep)):
            raise ValueError(f"a resize from {src} to {dst} devices cannot keep old ranks {keep}")
        return cls(epoch=epoch, src=src, dst=dst, why=why, requested_at=now, placement=placement,
                   deadline=now + timeout_s, step=step, timeout_s=timeout_s,
                   keep=list(keep) if keep is not None and list(keep) != list(range(dst)) else [], release=release,
                   blocks=blocks, src_blocks=src_blocks, after_step=after_step)

    # --- who moves ------------------------------------------------------------------------------------

    @property
    def joiners(self) -> list[int]:
        return list(range(self.src, self.dst))

    @property
    def leavers(self) -> list[int]:
        """Old ranks that leave."""
        if self.keep:
            return [r for r in range(self.src) if r not in self.keep]
        return list(range(self.dst, self.src))

    @property
    def stayers(self) -> list[int]:
        """Old ranks that stay, in their new rank order."""
        return list(self.keep) if self.keep else list(range(min(self.src, self.dst)))

    def joiners_on(self, place: str) -> list[int]:
        return [r for r in self.joiners if self.placement[r][0] == place]

    def nodes(self) -> list[str]:
        """The places of the new layout, in rank order of first appearance."""
        return list(dict.fromkeys(place for place, _dev in self.placement))

    # --- prepare -> go ---------------------------------------------------------------------------------

    def port_known(self, port: int, now: float) -> list[Action]:
        """The new group's rendezvous port was chosen (the first report of it counts)."""
        if self.phase != ResizePhase.PREPARE or self.port or not port:
            return []
        self.port = port
        return self._maybe_go(now)

    def joiner_ready(self, rank: int, now: float) -> list[Action]:
        """A joining rank's agent is warm (script loaded, said hello)."""
        if self.phase != ResizePhase.PREPARE or rank not in self.joiners or rank in self.ready:
            return []
        self.ready.append(rank)
        return self._maybe_go(now)

    def reached(self, step: int, now: float) -> list[Action]:
        """The job was reported at `step`: a plan prepared ahead goes once it is at its `after_step`."""
        if self.phase != ResizePhase.PREPARE or self.after_step < 0 or step < self.after_step:
            return []
        self.step, self.after_step = self.after_step, -1
        self.requested_at = now
        self.deadline = now + self.timeout_s
        return self._maybe_go(now)

    @property
    def ahead(self) -> bool:
        """Prepared ahead of its step, which the job has not reached yet."""
        return self.after_step >= 0

    def _maybe_go(self, now: float) -> list[Action]:
        if not self.port or len(self.ready) != len(self.joiners):
            return []
        if self.ahead:
            self.deadline = NO_DEADLINE   # warm and waiting for the step: nothing is late until it comes
            return []
        self.phase = ResizePhase.GO
        self.commanded_at = now
        self.deadline = now + self.timeout_s
        return [Go()]

    # --- go -> done ------------------------------------------------------------------------------------

    def reformed(self, rank: int) -> bool:
        """A rank of the new layout reported its re-formation finished; True if that is news."""
        if self.phase != ResizePhase.GO or not 0 <= rank < self.dst or rank in self.acked:
            return False
        self.acked.append(rank)
        return True

    def stepped(self, now: float, handover_s: float | None = None, stall_s: float | None = None) -> list[Action]:
        """Rank 0 completed a step at the new size (`handover_s`: its own time from vote to new group;
        `stall_s`: from its last step at the old size to this one)."""
        if self.phase != ResizePhase.GO:
            return []
        self.handover_s, self.stall_s = handover_s, stall_s
        return [Done(now - self.requested_at)] if len(self.acked) == self.dst else []

    def refused(self, reason: str) -> list[Action]:
        """The agents refused the resize at a step boundary (each says so; the first report counts). Before
        the go they can only at a scheduled step (`--scale-at`), stopped there while the joiners warm up."""
        if self.phase not in (ResizePhase.PREPARE, ResizePhase.GO):
            return []
        self.phase = ResizePhase.REFUSED
        self.failure = {"message": reason}
        return [Refuse(reason)]

    # --- failures --------------------------------------------------------------------------------------

    def agent_failed(self, now: float, error: dict[str, Any], *, joiner: bool) -> list[Action]:
        """An agent died or reported a failure (`joiner`: it hosted only joining ranks).

        Before the go a joiner's death calls the resize off, while an old agent's is the job's own
        failure (no action: the shell ends the job). After the go any death rolls the resize back.
        """
        if self.phase == ResizePhase.PREPARE:
            return [Abort(str(error.get("message", "a joining agent failed")))] if joiner else []
        if self.phase == ResizePhase.GO:
            return self._roll_back(now, self.name_in(error))
        return []

    def tick(self, now: float, places: list[str]) -> list[Action]:
        """The clock: a phase past its deadline (`places`: where agents of the job were started)."""
        if now <= self.deadline or self.phase == ResizePhase.REFUSED:
            return []
        t = self.timeout_s
        if self.phase == ResizePhase.PREPARE:
            missing = [r for r in self.joiners if r not in self.ready]
            what = f"joining ranks {missing} not ready" if missing else "no rendezvous port from rank 0's node"
            return [Abort(f"{what} within {t:.0f}s")]
        if self.phase == ResizePhase.GO:
            missing = [r for r in range(self.dst) if r not in self.acked]
            what = f"ranks {missing} did not re-form" if missing else "rank 0 did not complete a step"
            return self._roll_back(now, self.name_in({"message": f"{what} within {t:.0f}s"}))
        waiting = [n for n in places if n not in self.gone]
        return [Fail(f"resize {self.epoch} rollback timed out",
                     self._failure(f"its agents on {waiting} did not exit within {t:.0f}s, so it could not "
                                   "fall back"))]

    def name_in(self, error: dict[str, Any]) -> dict[str, Any]:
        """Name the resize in an error that happened while the job was re-forming (once: a shell may
        have named it already, to log it)."""
        if self.phase != ResizePhase.GO or error.get("resize_epoch") == self.epoch:
            return error
        error = dict(error)
        error["message"] = (f"resize {self.epoch} ({self.src} -> {self.dst} devices, {self.why}) failed: "
                            f"{error.get('message', 'agent failed')}")
        error["resize_epoch"] = self.epoch
        return error

    def _roll_back(self, now: float, error: dict[str, Any]) -> list[Action]:
        self.phase = ResizePhase.ROLLBACK
        self.failure = error
        self.deadline = now + self.timeout_s
        return [RollBack(error)]

    # --- rollback -> fall back --------------------------------------------------------------------------

    def note_saved(self, place: str, have: list[int]) -> bool:
        """The snapshot parts `place` holds for this resize; True if that is news."""
        if self.saved.get(place) == list(have):
            return False
        self.saved[place] = list(have)
        return True

    def place_gone(self, place: str) -> bool:
        """Every agent of the job at `place` exited; True if that is news."""
        if place in self.gone:
            return False
        self.gone.append(place)
        return True

    def missing_parts(self, workers: int) -> list[int]:
        return parts.missing(workers, {part for have in self.saved.values() for part in have})

    def settle(self, places: list[str], workers: int, dead: list[str] | None = None) -> list[Action]:
        """Once no agent runs at any of `places`: `FallBack`, or `Fail` when the snapshot lacks a part
        or a place of the old layout (`dead`) is gone with its parts and its devices."""
        if self.phase != ResizePhase.ROLLBACK or not all(n in self.gone for n in places):
            return []
        lost = self.missing_parts(workers)
        if lost or dead:
            what = (f"nodes {dead} of its layout are gone" if dead else
                    "its snapshot lacks " + parts.describe(lost) + " (an agent died before saving it)")
            return [Fail(f"resize {self.epoch} failed", self._failure(f"no complete snapshot to fall back to: {what}"))]
        return [FallBack()]

    def reason(self) -> str:
        """What failed, for the record of a rollback."""
        return str((self.failure or {}).get("message", "an agent failed"))

    def _failure(self, why: str) -> dict[str, Any]:
        err = dict(self.failure or {"message": "resize failed"})
        err["message"] = f"{err.get('message', 'resize failed')}; {why}"
        return err

