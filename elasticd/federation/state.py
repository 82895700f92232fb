"""The federation front's island table as a pure state machine: messages and clock ticks in, replies out.

An island is "up" from its hello until it says bye ("left") or stays silent past `timeout_s` ("lost"); an
island that comes back says hello again and is up again, keeping its place in the table. A status from
an island the front does not know (a restarted front) is answered `known=False`, so its scheduler says
hello again. No sockets here: elasticd/federation/server.py carries messages in and out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from elasticd import protocol as p
from elasticd.core.errors import ControlPlaneError
from elasticd.federation.events import IslandEvents

log = logging.getLogger(__name__)

UP, LOST, LEFT = "up", "lost", "left"
MAX_ISLANDS = 1024   # a front of more islands than this is not one this table was sized for


@dataclass(slots=True)
class Island:
    island_id: str
    capacity: p.IslandCapacity
    joined_at: float
    last_seen: float
    state: str = UP
    reason: str = ""
    seq: int = 0

    def info(self) -> p.IslandInfo:
        return p.IslandInfo(island_id=self.island_id, state=self.state, capacity=self.capacity,
                            joined_at=self.joined_at, last_seen=self.last_seen, reason=self.reason)


class FederationError(ControlPlaneError):
    """A request the front refuses; `code` is a protocol error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass
class FederationState:
    timeout_s: float = 10.0
    islands: dict[str, Island] = field(default_factory=dict)
    events: IslandEvents = field(default_factory=IslandEvents)

    def hello(self, msg: p.IslandHello, now: float) -> p.IslandAck:
        isl = self.islands.get(msg.island_id)
        if isl is None:
            if len(self.islands) >= MAX_ISLANDS:
                raise FederationError(p.QUOTA, f"the front knows {MAX_ISLANDS} islands already")
            self.islands[msg.island_id] = Island(msg.island_id, msg.capacity, now, now)
            log.info("island %s joined: %s", msg.island_id, _shown(msg.capacity))
            self.events.add(now, "island_joined", msg.island_id, _shown(msg.capacity))
        else:
            if isl.state != UP:
                log.info("island %s is back (was %s: %s): %s", msg.island_id, isl.state, isl.reason,
                         _shown(msg.capacity))
                self.events.add(now, "island_back", msg.island_id, f"was {isl.state}: {isl.reason}")
            isl.capacity, isl.joined_at, isl.last_seen, isl.state, isl.reason, isl.seq = (
                msg.capacity, now, now, UP, "", 0)
        return p.IslandAck(seq=0, known=True)

    def status(self, msg: p.IslandStatus, now: float) -> p.IslandAck:
        isl = self.islands.get(msg.island_id)
        if isl is None or isl.state != UP:
            return p.IslandAck(seq=msg.seq, known=False)   # lost or left meanwhile: a hello brings it back
        isl.capacity, isl.last_seen, isl.seq = msg.capacity, now, msg.seq
        return p.IslandAck(seq=msg.seq, known=True)

    def bye(self, msg: p.IslandBye, now: float) -> None:
        isl = self.islands.get(msg.island_id)
        if isl is not None and isl.state == UP:
            isl.state, isl.reason, isl.last_seen = LEFT, "its scheduler shut down", now
            log.info("island %s left", msg.island_id)
            self.events.add(now, "island_left", msg.island_id, isl.reason)

    def tick(self, now: float) -> list[str]:
        """Islands silent past the timeout become lost; returns their ids."""
        lost = []
        for isl in self.islands.values():
            if isl.state == UP and now - isl.last_seen > self.timeout_s:
                isl.state, isl.reason = LOST, f"no status for {now - isl.last_seen:.0f}s"
                log.warning("island %s lost: %s", isl.island_id, isl.reason)
                self.events.add(now, "island_lost", isl.island_id, isl.reason)
                lost.append(isl.island_id)
        return lost

    def table(self) -> p.IslandsReply:
        return p.IslandsReply(islands=[isl.info() for _, isl in sorted(self.islands.items())])


def _shown(c: p.IslandCapacity) -> str:
    return f"{c.nodes} node(s), {c.free}/{c.devices} devices free, {c.running} job(s) running, {c.queued} queued"
