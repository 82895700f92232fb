"""What island schedulers and a federation front say to each other, and what a client may ask the front.

An island scheduler joins the front with `IslandHello` and keeps it current with `IslandStatus` (every
heartbeat); the front answers both with `IslandAck`, whose `known` tells a scheduler the front lost it (a
restarted front) and must say hello again. `ListIslands` asks the front for its island table.
"""

from __future__ import annotations

from dataclasses import field
from typing import ClassVar

from elasticd.protocol import limits as L
from elasticd.protocol.spans import PortionRow
from elasticd.protocol.wire import Message, message, record

MAX_PORTION_ROWS = 4096   # portions one island reports in a status


@record
class IslandCapacity:
    """What an island's scheduler has to offer: its live nodes and devices, and what runs there."""

    nodes: int = 0
    devices: int = 0          # on its live nodes
    free: int = 0             # of those, not held by a job (nor by agents still exiting)
    running: int = 0          # jobs placed there (starting, running, resizing or recovering)
    queued: int = 0           # jobs waiting for devices
    device_types: list[str] = field(default_factory=list)   # the kinds of device it has ("cpu", "cuda")
    # Its free devices' speeds added up (1.0 each unless declared or measured: elasticd/placement/speeds.py);
    # 0: not reported.
    free_speed: float = 0.0


def _bad_capacity(island_id: str, c: IslandCapacity) -> str | None:
    if (why := L.bad_island_id(island_id)):
        return why
    counts = (c.nodes, c.devices, c.free, c.running, c.queued)
    if min(counts) < 0 or max(counts) > L.MAX_ISLAND_COUNT or c.free > c.devices:
        return f"capacity {counts}: counts must be in 0..{L.MAX_ISLAND_COUNT}, free at most devices"
    if not 0 <= c.free_speed <= 1e9:   # NaN fails this too
        return f"free_speed {c.free_speed}: a speed total in 0..1e9"
    if len(c.device_types) > 8 or any(L.bad_text("device type", t, 16) for t in c.device_types):
        return "device_types: at most 8 names of at most 16 characters"
    return None


@message
class IslandHello(Message):
    """Island scheduler -> front: this island joins (again), with what it has now."""

    op: ClassVar[str] = "island_hello"
    island_id: str
    capacity: IslandCapacity = field(default_factory=IslandCapacity)

    def check(self) -> str | None:
        return _bad_capacity(self.island_id, self.capacity)


@message
class IslandStatus(Message):
    """Island scheduler -> front, every heartbeat."""

    op: ClassVar[str] = "island_status"
    island_id: str
    seq: int = 0
    capacity: IslandCapacity = field(default_factory=IslandCapacity)
    portions: list[PortionRow] = field(default_factory=list)   # its portions of jobs spanning islands

    def check(self) -> str | None:
        if len(self.portions) > MAX_PORTION_ROWS:
            return f"{len(self.portions)} portion rows, at most {MAX_PORTION_ROWS}"
        return _bad_capacity(self.island_id, self.capacity)


@message
class IslandBye(Message):
    """Island scheduler -> front: it is shutting down (not lost: gone on purpose)."""

    op: ClassVar[str] = "island_bye"
    island_id: str

    def check(self) -> str | None:
        return L.bad_island_id(self.island_id)


@message
class IslandAck(Message):
    op: ClassVar[str] = "island_ack"
    seq: int = 0
    known: bool = True        # False: the front does not know this island (say hello again)


@message
class ListIslands(Message):
    """Client -> front: the island table."""

    op: ClassVar[str] = "islands"


@record
class IslandInfo:
    island_id: str
    state: str                # "up", "lost" (silent past the timeout) or "left" (said bye)
    capacity: IslandCapacity
    joined_at: float          # wall clock of its latest hello
    last_seen: float
    reason: str = ""          # why it is lost or left


@message
class IslandsReply(Message):
    op: ClassVar[str] = "islands_reply"
    islands: list[IslandInfo] = field(default_factory=list)
