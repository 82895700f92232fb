"""A request/reply client of a daemon or scheduler: the CLI's (elasticd.cli.client), and the in-process node's
of `elasticd run` (elasticd.local_node). No click here: the CLI turns these errors into exit codes."""

from __future__ import annotations

import time
from dataclasses import dataclass

import zmq

from elasticd import protocol as p
from elasticd import transport
from elasticd.core.errors import ControlPlaneError, UnreachableError

DEFAULT_TIMEOUT_S = 5.0


class Unreachable(UnreachableError):
    """No answer: no daemon, a dead one, a wrong endpoint, or a refused key."""


class ErrorReply(ControlPlaneError):
    """The daemon or scheduler answered with a typed error."""

    def __init__(self, error: p.Error) -> None:
        super().__init__(f"{error.code}: {error.message}")
        self.error = error


@dataclass(slots=True)
class Target:
    endpoint: str
    server_key: bytes | None = None
    identity: tuple[bytes, bytes] | None = None
    what: str = "daemon"


class Client:
    """A request/reply connection (DEALER, so a lost reply is a timeout, not a stuck socket)."""

    def __init__(self, target: Target, timeout_s: float = DEFAULT_TIMEOUT_S, ctx: zmq.Context | None = None) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._own_ctx = ctx is None
        self.ctx = ctx or zmq.Context()
        self.sock = transport.dealer(self.ctx, immediate=False)
        self._monitor: zmq.Socket | None = None
        if target.server_key is not None:
            assert target.identity is not None
            transport.curve_client(self.sock, target.identity, target.server_key)
            self._monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                                         | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
        self.sock.connect(target.endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        if self._monitor is not None:
            self._poller.register(self._monitor, zmq.POLLIN)
        self._rid = 0

    def request(self, msg: p.Message, timeout_s: float | None = None) -> p.Message:
        """Send `msg` and wait for its reply.

        Raises:
            ErrorReply: the peer answered with an `Error`.
            Unreachable: no reply in time, or the peer refused our CURVE key.
        """
        self._rid += 1
        msg.rid = self._rid
        self.sock.send(msg.encode())
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Unreachable(f"no answer from the {self.target.what} within "
                                  f"{self.timeout_s if timeout_s is None else timeout_s:.1f}s")
            ready = dict(self._poller.poll(min(left, 0.5) * 1000))
            if self._monitor is not None and self._monitor in ready:
                self._check_monitor()
            if self.sock in ready:
                try:
                    reply = p.decode(self.sock.recv())
                except p.ProtocolError as e:
                    raise ErrorReply(p.Error(code=e.code, message=f"unreadable reply from the {self.target.what}: "
                                                                  f"{e.message}")) from None
                if reply.rid != msg.rid:
                    continue  # a late reply to an earlier request that timed out
                if isinstance(reply, p.Error):
                    raise ErrorReply(reply)
                return reply

    def _check_monitor(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        assert self._monitor is not None
        while self._monitor.poll(0):
            ev = recv_monitor_message(self._monitor)
            if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise Unreachable(f"the {self.target.what} refused this client: its key is not on the "
                                  "allow-list (add it there with `elasticd keygen --allow KEY`)")
            if ev["event"] == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
                raise Unreachable(f"CURVE handshake with the {self.target.what} failed (wrong --server-key?)")

    def close(self) -> None:
        if self._monitor is not None:
            self.sock.disable_monitor()
            self._monitor.close(linger=0)
        self.sock.close(linger=0)
        if self._own_ctx:
            self.ctx.term()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
