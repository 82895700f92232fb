"""A job that spans islands: what a client asks the front, what the front tells island schedulers about
their portions, and what they report back.

The front splits the job into one portion per island (elasticd/federation/spans.py decides). Each island's
scheduler gets `ReservePortion`, queues the portion as a job of its own and holds its devices once placed
(`reserved`); `StartPortion` launches it, with the rendezvous of the whole job; `CancelPortion` releases or
stops it. Each island reports its portions in every `IslandStatus` (`PortionRow`), full state, so a lost
message is repaired by the next beat.

A running job grows onto an island live (elasticd/federation/moves.py): the island's portion is reserved
with `join_from` and started as warm joiners; the running portions get `MovePortion` (the one hosting
rank 0 picks the new group's port); `GoPortion` then re-forms every agent at the next step boundary, and
`AbortPortionMove` calls off a move that has not gone.
"""

from __future__ import annotations

from dataclasses import field
from typing import ClassVar

from elasticd.protocol import limits as L
from elasticd.protocol.nodes import bad_blocks, bad_islands
from elasticd.protocol.wire import Message, message, record

MAX_SPAN_ISLANDS = 64   # islands one job may span


def bad_span_id(value: str) -> str | None:
    return L.bad_job_id(value)


@record
class PortionSpec:
    """One island's part of a spanning job: its agents are ranks rank_offset.. of the job's `world`."""

    span_id: str
    attempt: int              # +1 each time the front reserves the job's portions anew
    index: int                # the island's place in the job; portion 0 hosts rank 0 (the rendezvous)
    workers: int              # N of the whole job
    world: int                # M: agents of the whole job, on every island together
    rank_offset: int          # the rank of this portion's first agent
    blocks: list[int]         # the whole job's layout: logical workers per agent, in rank order
    islands: list[int]        # agents per island, in rank order (the two-level sums' islands)
    key: str = ""             # names the job's periodic snapshots on every node, the same on every attempt
    restore: bool = False     # start from the newest complete periodic snapshot its nodes hold (a restart)
    # > 0: a portion joining the running job of that many agents live (resize `epoch`): its agents start
    # as warm joiners and take their state from the running ones at the go (`GoPortion`).
    join_from: int = 0
    epoch: int = 0

    @property
    def devices(self) -> int:
        return self.islands[self.index]

    @property
    def own_blocks(self) -> list[int]:
        return self.blocks[self.rank_offset:self.rank_offset + self.devices]

    def check(self) -> str | None:
        if (why := bad_span_id(self.span_id)) or (why := bad_blocks(self.blocks, self.world, self.workers)):
            return why
        if not 0 < len(self.islands) <= MAX_SPAN_ISLANDS or min(self.islands) < 1 or sum(self.islands) != self.world:
            return f"islands {self.islands[:8]}: 1..{MAX_SPAN_ISLANDS} positive agent counts summing to {self.world}"
        if not 0 <= self.index < len(self.islands) or self.rank_offset != sum(self.islands[:self.index]):
            return f"portion {self.index} at rank {self.rank_offset} is not one of islands {self.islands}"
        if not 0 <= self.attempt <= L.MAX_ISLAND_COUNT:
            return f"attempt {self.attempt} out of range"
        if not 0 <= self.join_from < self.world or (self.join_from and not self.rank_offset >= self.join_from):
            return f"a portion joining {self.join_from} agents must come after them in a job of {self.world}"
        if not 0 <= self.epoch <= L.MAX_ISLAND_COUNT:
            return f"epoch {self.epoch} out of range"
        return L.bad_snapshot_key(self.key)


@message
class SubmitSpanning(Message):
    """Client -> front: a job whose N workers are split over islands (`--islands`, or up to `max_islands`)."""

    op: ClassVar[str] = "submit_spanning"
    script: str
    func: str | None = None
    workers: int
    devices: int = 0              # M, on every island together (0: N, or as many as are free if fewer)
    islands: list[str] = field(default_factory=list)   # these islands, in rank order; empty: the front picks
    max_islands: int = 0          # when the front picks: at most this many (0: as many as it takes)
    priority: int = 0
    name: str = ""
    cwd: str = ""
    env: dict[str, str] = field(default_factory=dict)
    snapshot_every: str = "30s"   # periodic snapshots, kept on another island too: what a restart resumes from
    threads: int = 0
    max_restarts: int = 3         # restarts of the whole job after infrastructure failures (an island lost)

    def check(self) -> str | None:
        if not 0 <= self.max_restarts <= 10_000:
            return f"max_restarts must be in 0..10000, got {self.max_restarts}"
        if not 1 <= self.workers <= L.MAX_WORKERS or not 0 <= self.devices <= self.workers:
            return f"need 1 <= workers <= {L.MAX_WORKERS} and 0 <= devices <= workers, got {self.workers}, {self.devices}"
        if len(self.islands) > MAX_SPAN_ISLANDS or not 0 <= self.max_islands <= MAX_SPAN_ISLANDS:
            return f"at most {MAX_SPAN_ISLANDS} islands"
        if len(set(self.islands)) != len(self.islands):
            return f"islands {self.islands}: each at most once"
        for i in self.islands:
            if (why := L.bad_island_id(i)):
                return why
        if abs(self.priority) > L.MAX_PRIORITY:
            return f"priority must be in -{L.MAX_PRIORITY}..{L.MAX_PRIORITY}, got {self.priority}"
        if len(self.env) > L.MAX_ENV_ITEMS:
            return f"env has {len(self.env)} variables, at most {L.MAX_ENV_ITEMS} are allowed"
        return (L.bad_text("script", self.script, L.MAX_PATH, path=True) or L.bad_text("name", self.name, L.MAX_NAME)
                or L.bad_agent_options(self.threads, 0))


@message
class ReservePortion(Message):
    """Front -> island: queue this portion and hold its devices once placed; launch nothing yet."""

    op: ClassVar[str] = "reserve_portion"
    portion: PortionSpec
    script: str
    func: str | None = None
    name: str = ""
    cwd: str = ""
    env: dict[str, str] = field(default_factory=dict)
    priority: int = 0
    snapshot_every: str = "0"
    threads: int = 0
    owner: str = ""           # who submitted it at the front (recorded; the island's own clients are not it)

    def check(self) -> str | None:
        return (self.portion.check() or L.bad_text("script", self.script, L.MAX_PATH, path=True)
                or L.bad_agent_options(self.threads, 0))


@message
class StartPortion(Message):
    """Front -> island: every portion is reserved; launch this one. Portion 0 gets no master (its rank 0's
    node picks the rendezvous port, reported back in its row); the others get portion 0's."""

    op: ClassVar[str] = "start_portion"
    span_id: str
    attempt: int
    master_addr: str = ""
    master_port: int = 0

    def check(self) -> str | None:
        if not 0 <= self.master_port < 65536:
            return f"master_port {self.master_port} out of range"
        return bad_span_id(self.span_id) or L.bad_text("master_addr", self.master_addr, 255)


@message
class CancelPortion(Message):
    """Front -> island: release this portion's reservation, or stop its agents."""

    op: ClassVar[str] = "cancel_portion"
    span_id: str
    attempt: int
    reason: str = ""

    def check(self) -> str | None:
        return bad_span_id(self.span_id)


@message
class MovePortion(Message):
    """Front -> island: the running job moves live at resize `epoch`, once the front says go: it grows onto
    other islands (`keep` empty: every agent stays, joiners come after), or shrinks off ranks its islands
    want back (`keep`: the old ranks that stay, in their new rank order). This portion becomes portion
    `index` of the new group (-1: none of its agents stays; it leaves the job). The portion hosting the new
    rank 0 picks the new group's rendezvous port now, reported in its row."""

    op: ClassVar[str] = "move_portion"
    span_id: str
    attempt: int
    epoch: int
    devices_from: int             # agents of the job before the move
    world: int                    # and after it
    blocks: list[int]             # the new layout
    islands: list[int]            # the new group's agents per island
    keep: list[int] = field(default_factory=list)
    index: int = 0

    def check(self) -> str | None:
        if (why := bad_span_id(self.span_id) or bad_blocks(self.blocks, self.world) or bad_islands(self.islands, self.world)):
            return why
        if not self.islands or not 0 < self.epoch <= L.MAX_ISLAND_COUNT or not -1 <= self.index < len(self.islands):
            return f"move {self.epoch}: portion {self.index} of islands {self.islands[:8]}"
        if self.keep:
            if len(set(self.keep)) != len(self.keep) or len(self.keep) != self.world or not all(
                    0 <= k < self.devices_from for k in self.keep):
                return f"keep {self.keep[:16]}: {self.world} distinct ranks of the {self.devices_from} agents"
        elif not 0 < self.devices_from < self.world:
            return f"a grow from {self.devices_from} agents to {self.world}"
        return None


@message
class GoPortion(Message):
    """Front -> island: every joiner is warm and the port is picked; the portion's agents re-form at their
    next step boundary (joiners join) at master_addr:master_port."""

    op: ClassVar[str] = "go_portion"
    span_id: str
    attempt: int
    epoch: int
    master_addr: str
    master_port: int

    def check(self) -> str | None:
        if not 0 < self.master_port < 65536:
            return f"master_port {self.master_port} out of range"
        return bad_span_id(self.span_id) or L.bad_text("master_addr", self.master_addr, 255)


@message
class AbortPortionMove(Message):
    """Front -> island: the move `epoch` will not happen (a joining island failed, or it was not ready in
    time); a running portion stays as it is."""

    op: ClassVar[str] = "abort_portion_move"
    span_id: str
    attempt: int
    epoch: int
    reason: str = ""

    def check(self) -> str | None:
        return bad_span_id(self.span_id)


@record
class PortionRow:
    """Island -> front, in every status: one portion as the island's scheduler has it."""

    span_id: str
    attempt: int
    index: int
    job_id: str               # the island's own id of the portion
    state: str                # the island job's state (queued, reserved, starting, running, ...)
    step: int = 0
    steps_per_s: float = 0.0
    master_addr: str = ""     # portion 0, once its rank 0's node picked the port
    master_port: int = 0
    error: str = ""
    cause: str = ""           # its failure's cause (elasticd/core/failures.py): the front restarts the job
                              # after the infrastructure's, never after the script's
    # A live move (MovePortion, or a joining portion): its epoch; the port, once the portion hosting rank 0
    # picked it; ready: its part is prepared (joiners warm, the port picked); moved: every agent of the
    # portion re-formed at that epoch and completed a step after it.
    move_epoch: int = 0
    move_addr: str = ""
    move_port: int = 0
    move_ready: bool = False
    moved: bool = False
    move_error: str = ""      # why the move failed here (its agents refused it, a joiner died)
    # Ranks of this portion its island wants back (their node is draining): the front moves the job off them.
    leaving: list[int] = field(default_factory=list)


@message
class ListSpans(Message):
    """Client -> front: the jobs spanning islands (one, or all)."""

    op: ClassVar[str] = "spans"
    span_id: str = ""


@record
class PortionInfo:
    island: str
    index: int
    devices: int
    workers: int
    ranks: str                # "0-1"
    job_id: str = ""          # on the island; "" before it was reserved there
    state: str = ""           # as the island last reported it
    step: int = 0
    error: str = ""


@record
class SpanInfo:
    span_id: str
    name: str
    state: str                # waiting, reserving, starting, running, recovering, finished, failed, stopped
    reason: str               # why it is in that state (what it waits for, what failed)
    workers: int
    devices: int
    owner: str
    submitted_at: float
    attempt: int
    step: int = 0
    steps_per_s: float = 0.0
    restarts: int = 0
    portions: list[PortionInfo] = field(default_factory=list)
    history: list[tuple[float, str, str]] = field(default_factory=list)


@message
class SpansReply(Message):
    op: ClassVar[str] = "spans_reply"
    spans: list[SpanInfo] = field(default_factory=list)


@message
class SpanSubmitted(Message):
    op: ClassVar[str] = "span_submitted"
    job_id: str
