"""The federation front's I/O shell: CURVE-authenticated ZeroMQ in, elasticd/federation/state.py decides.

Island schedulers and clients connect to `bind` (CURVE; keys on the allow-list of the front's state dir,
each with its role: elasticd/federation/authz.py); the front's own user also reaches it on an ipc socket in
its state dir. Every frame is decoded strictly; a bad one gets an error reply and the front keeps serving.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from pathlib import Path

import zmq

from elasticd import keys, transport
from elasticd import protocol as p
from elasticd.federation import authz
from elasticd.federation.state import FederationError, FederationState
from elasticd.scheduler import admission
from elasticd.scheduler import authz as principals
from elasticd.statedir import StateDir, write_info

log = logging.getLogger(__name__)

_BATCH = 256


def sock_path(sd: StateDir) -> Path:
    return sd.root / "federation.sock"


def info_path(sd: StateDir) -> Path:
    return sd.root / "federation.json"


class FederationServer:
    """Raises:
        transport.TransportError: if an endpoint cannot be bound.
    """

    def __init__(self, state_dir: StateDir, *, bind: str | None, timeout_s: float = 10.0,
                 ctx: zmq.Context | None = None) -> None:
        self.sd = state_dir.create()
        self.ctx = ctx or zmq.Context.instance()
        self.state = FederationState(timeout_s=timeout_s)
        self.identity = keys.ensure_identity(self.sd.root)
        self._stop = threading.Event()
        self._auth = None
        self.sockets: list[zmq.Socket] = []
        self._tcp: zmq.Socket | None = None
        self.tcp_endpoint: str | None = None
        self.allow: transport.AllowList | None = None
        self._refused = principals.Refusals(log)
        self._budget = admission.KeyBudget()   # requests per second of each client and admin key
        try:
            if bind:
                transport.raise_fd_limit()
                self.allow = transport.AllowList(self.sd.root)
                self._auth = transport.start_authenticator(self.ctx, self.allow)
                sock = transport.router(self.ctx)
                self.sockets.append(sock)
                transport.curve_server(sock, self.identity)
                self.tcp_endpoint = transport.bind_tcp(sock, bind)
                self._tcp = sock
            sock = transport.router(self.ctx)
            self.sockets.append(sock)
            self.local_endpoint = transport.bind_ipc(sock, sock_path(self.sd))
        except Exception:
            self.close()
            raise
        log.info("federation front serving tcp=%s local=%s", self.tcp_endpoint, self.local_endpoint)

    @property
    def public_key(self) -> str:
        return self.identity[0].decode()

    def write_info(self) -> None:
        write_info(info_path(self.sd), {"pid": os.getpid(), "tcp": self.tcp_endpoint, "local": self.local_endpoint,
                                        "public_key": self.public_key})

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        poller = zmq.Poller()
        for s in self.sockets:
            poller.register(s, zmq.POLLIN)
        next_tick = time.monotonic()
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(timeout=200))
                for sock in self.sockets:
                    if sock in ready:
                        self._drain(sock)
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + min(1.0, self.state.timeout_s / 4)
                    self.state.tick(time.time())
        finally:
            self.close()

    def close(self) -> None:
        for s in self.sockets:
            s.close(linger=0)
        self.sockets = []
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    def _drain(self, sock: zmq.Socket) -> None:
        for _ in range(_BATCH):
            got = transport.recv_request(sock)
            if got is None:
                return
            ident, payload, extra, user_id = got
            self._serve(sock, ident, payload, extra, user_id)

    def _serve(self, sock: zmq.Socket, ident: bytes, payload: bytes, extra: int, user_id: str | None) -> None:
        if extra:
            transport.send(sock, p.Error(code=p.BAD_FRAME, message=f"expected 1 frame, got {extra + 1}"), ident)
            return
        try:
            msg = p.decode(payload)
        except p.ProtocolError as e:
            transport.send(sock, p.error_from(e, p.peek_rid(payload)), ident)
            return
        who = principals.peer(user_id, self.allow, local=sock is not self._tcp)
        reply: p.Message | None
        if who is None:
            reply = p.Error(code=p.FORBIDDEN, message="this key is no longer on the allow-list")
        elif (busy := self._budget.busy(who, keys.ISLAND, time.monotonic())) is not None:
            # An island's status must not wait behind a client's flood, or the island would be declared lost.
            reply = p.Error(code=p.BUSY, message=busy)
        elif (why := authz.check(who, msg)) is not None:
            self._refused(who, msg, why, str(getattr(msg, "island_id", "")))
            reply = p.Error(code=p.FORBIDDEN, message=why)
        else:
            try:
                reply = self._dispatch(msg)
            except FederationError as e:
                reply = p.Error(code=e.code, message=e.message)
            except Exception as e:  # the front must outlive any one request
                log.exception("internal error serving %s", msg.op)
                reply = p.Error(code=p.INTERNAL, message=f"{type(e).__name__}: {e}")
        if reply is not None:
            reply.rid = msg.rid
            transport.send(sock, reply, ident)

    def _dispatch(self, msg: p.Message) -> p.Message | None:
        now = time.time()
        if isinstance(msg, p.IslandHello):
            return self.state.hello(msg, now)
        if isinstance(msg, p.IslandStatus):
            return self.state.status(msg, now)
        if isinstance(msg, p.IslandBye):
            self.state.bye(msg, now)
            return None
        if isinstance(msg, p.ListIslands):
            return self.state.table()
        raise FederationError(p.UNEXPECTED, f"a federation front does not serve {msg.op}")

