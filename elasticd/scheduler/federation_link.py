"""An island scheduler's link to its federation front: hello, a status every heartbeat, bye at shutdown;
and the front's commands about this island's portions of jobs spanning islands, which reach the scheduler
only this way (its own CURVE connection to the front whose key it was given).

What it reports is the island's capacity as its scheduler's state shows it (live nodes, their devices,
those free, jobs placed and queued). A front that answers `known=False` (restarted, or it declared the
island lost) gets a hello again at the next beat. A front that is down costs nothing: the DEALER drops
what it cannot deliver (IMMEDIATE), and the island schedules its own nodes as before.
"""

from __future__ import annotations

import logging

import zmq

from elasticd import protocol as p
from elasticd import transport
from elasticd.scheduler.jobs import JobState
from elasticd.scheduler.state import SchedulerState

log = logging.getLogger(__name__)

_COMMANDS = (p.ReservePortion, p.StartPortion, p.CancelPortion, p.MovePortion, p.GoPortion, p.AbortPortionMove)


def capacity(state: SchedulerState) -> p.IslandCapacity:
    live = [nd for nd in state.nodes.values() if nd.alive and nd.known]
    jobs = list(state.jobs.values())
    free = [(v.node_id, d) for v in state.free_views() for d in v.free]
    return p.IslandCapacity(
        free_speed=round(sum(state.speeds.speed(node, d) for node, d in free), 3),
        nodes=len(live), devices=sum(len(nd.devices) for nd in live), free=len(free),
        running=sum(j.state.active for j in jobs), queued=sum(j.state is JobState.QUEUED for j in jobs),
        device_types=sorted({d.split(":", 1)[0] for nd in live for d in nd.devices}))


class FederationLink:
    def __init__(self, ctx: zmq.Context, identity: tuple[bytes, bytes], endpoint: str, server_key: bytes,
                 island_id: str, every_s: float) -> None:
        if not transport.is_tcp(endpoint):
            raise transport.TransportError(f"--federation must be a tcp:// endpoint, got {endpoint!r}")
        self.island_id = island_id
        self.every_s = every_s
        self.sock = transport.dealer(ctx)
        transport.curve_client(self.sock, identity, server_key)
        self.sock.connect(endpoint)
        self.endpoint = endpoint
        self.welcomed = False
        self.seq = 0
        self._next = 0.0
        self._last_error = ""

    def beat(self, state: SchedulerState, now: float) -> None:
        if now < self._next:
            return
        self._next = now + self.every_s
        cap = capacity(state)
        if self.welcomed:
            self.seq += 1
            transport.send(self.sock, p.IslandStatus(island_id=self.island_id, seq=self.seq, capacity=cap,
                                                     portions=state.portions.rows()))
        else:
            transport.send(self.sock, p.IslandHello(island_id=self.island_id, capacity=cap))

    def readable(self) -> list[p.Message]:
        """Take the front's answers (never blocks); returns its commands about portions of jobs spanning
        islands, for the scheduler (elasticd.scheduler.portions)."""
        commands: list[p.Message] = []
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return commands
            try:
                msg = p.decode(frames[-1])
            except p.ProtocolError as e:
                self._error(f"unreadable answer from the front: {e.message}")
                continue
            if isinstance(msg, _COMMANDS):
                commands.append(msg)
            elif isinstance(msg, p.IslandAck):
                if self.welcomed and not msg.known:
                    log.info("federation front %s lost island %s; saying hello again", self.endpoint, self.island_id)
                    self._next = 0.0
                if msg.known and not self.welcomed:
                    log.info("island %s joined the federation front %s", self.island_id, self.endpoint)
                self.welcomed = msg.known
                self._last_error = ""
            elif isinstance(msg, p.Error):
                self.welcomed = False
                self._error(f"{msg.code}: {msg.message}")

    def _error(self, text: str) -> None:
        if text != self._last_error:   # once per distinct error, not once per beat
            log.error("federation front %s: %s", self.endpoint, text)
            self._last_error = text

    def close(self) -> None:
        if self.welcomed:
            transport.send(self.sock, p.IslandBye(island_id=self.island_id))
        self.sock.close(linger=500)
