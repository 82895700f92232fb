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
from elasticd.federation import authz, events
from elasticd.federation.observe import FrontWatch
from elasticd.federation.spans import MAX_ACTIVE_PER_OWNER, Send, Span, Spans
from elasticd.federation.state import UP, FederationError, FederationState
from elasticd.federation.store import SpanStore
from elasticd.scheduler import admission
from elasticd.scheduler import authz as principals
from elasticd.statedir import StateDir, write_info

log = logging.getLogger(__name__)

_BATCH = 256


def sock_path(sd: StateDir) -> Path:
    return sd.federation_sock


def info_path(sd: StateDir) -> Path:
    return sd.federation_info


class FederationServer:
    """Raises:
        transport.TransportError: if an endpoint cannot be bound.
    """

    def __init__(self, state_dir: StateDir, *, bind: str | None, timeout_s: float = 10.0,
                 reserve_timeout_s: float = 30.0, ctx: zmq.Context | None = None,
                 metrics: tuple[str, int] | None = None) -> None:
        self.sd = state_dir.create()
        self.ctx = ctx or zmq.Context.instance()
        self.state = FederationState(timeout_s=timeout_s)
        self.spans = Spans(reserve_timeout_s=reserve_timeout_s, retry_s=min(5.0, reserve_timeout_s))
        self._routes: dict[str, tuple[zmq.Socket, bytes]] = {}   # island id -> where its scheduler listens
        self.identity = keys.ensure_identity(self.sd.root)
        self._stop = threading.Event()
        self._auth = None
        self.sockets: list[zmq.Socket] = []
        self._tcp: zmq.Socket | None = None
        self.tcp_endpoint: str | None = None
        self.allow: transport.AllowList | None = None
        self._refused = principals.Refusals(log)
        self._budget = admission.KeyBudget()   # requests per second of each client and admin key
        self.watch: FrontWatch | None = None
        self.store: SpanStore | None = None
        try:
            self.store = SpanStore(self.sd.root / "federation.db")
            self.spans.load(self.store.load(), time.time())
            if metrics is not None:
                self.watch = FrontWatch(*metrics)
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

    @property
    def metrics_url(self) -> str | None:
        return self.watch.url if self.watch is not None else None

    def write_info(self) -> None:
        write_info(info_path(self.sd), {"pid": os.getpid(), "tcp": self.tcp_endpoint, "local": self.local_endpoint,
                                        "public_key": self.public_key, "metrics": self.metrics_url})

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
                    next_tick = time.monotonic() + min(0.25, self.state.timeout_s / 4)
                    self._tick(time.time())
        finally:
            self.close()

    def _tick(self, now: float) -> None:
        try:
            out: list[Send] = []
            for island in self.state.tick(now):
                out += self.spans.island_lost(island, self.state.islands[island].reason, now)
            self._send(out + self.spans.tick(now, self._free(), self._speed()))
            self._persist()
            if self.watch is not None:
                self.watch.observer.refresh(self.spans, self.state, now)
        except Exception:  # a bug in one tick must not take the front down
            log.exception("federation tick failed")

    def _persist(self) -> None:
        if self.store is not None:
            self.store.sync(self.spans.spans)

    def _span(self, span_id: str):
        try:
            return self.spans.get(span_id)
        except KeyError as e:
            raise FederationError(p.UNKNOWN_JOB, str(e.args[0])) from None

    def _free(self) -> dict[str, int]:
        return {i.island_id: i.capacity.free for i in self.state.islands.values() if i.state == UP}

    def _speed(self) -> dict[str, float]:
        return {i.island_id: i.capacity.free_speed for i in self.state.islands.values() if i.state == UP}

    def _send(self, out: list[Send]) -> None:
        for island, msg in out:
            route = self._routes.get(island)
            if route is None:
                log.warning("no route to island %s for %s", island, msg.op)
                continue
            transport.send(route[0], msg, route[1])

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        if self.store is not None:
            self.store.close()
            self.store = None
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
            started = time.perf_counter()
            try:
                reply = self._dispatch(msg, who, sock, ident)
            except FederationError as e:
                reply = p.Error(code=e.code, message=e.message)
            except Exception as e:  # the front must outlive any one request
                log.exception("internal error serving %s", msg.op)
                reply = p.Error(code=p.INTERNAL, message=f"{type(e).__name__}: {e}")
            if self.watch is not None:
                self.watch.observer.request(msg.op, time.perf_counter() - started)
                if isinstance(msg, p.IslandStatus):
                    self.watch.observer.statuses.inc()
        self._persist()   # before the answer: a job a client was told of survives the front
        if reply is not None:
            reply.rid = msg.rid
            transport.send(sock, reply, ident)

    def _dispatch(self, msg: p.Message, who: principals.Principal, sock: zmq.Socket, ident: bytes
                  ) -> p.Message | None:
        now = time.time()
        if isinstance(msg, (p.IslandHello, p.IslandStatus)):
            self._routes[msg.island_id] = (sock, ident)
        if isinstance(msg, p.IslandHello):
            return self.state.hello(msg, now)
        if isinstance(msg, p.IslandStatus):
            ack = self.state.status(msg, now)
            if ack.known:
                self._send(self.spans.rows(msg.island_id, msg.portions, now))
            return ack
        if isinstance(msg, p.IslandBye):
            self.state.bye(msg, now)
            self._send(self.spans.island_lost(msg.island_id, "its scheduler shut down", now))
            return None
        if isinstance(msg, p.ListIslands):
            return self.state.table()
        if isinstance(msg, p.SubmitSpanning):
            if not who.admin and self.spans.active(who.owner) >= MAX_ACTIVE_PER_OWNER:
                raise FederationError(p.QUOTA, f"{who.describe()} has {MAX_ACTIVE_PER_OWNER} jobs not ended at this "
                                      "front, the most one key may; stop one or wait for one to end")
            span, out = self.spans.submit(msg, who.owner, now, self._free(), self._speed())
            self._send(out)
            return p.SpanSubmitted(job_id=span.span_id)
        if isinstance(msg, p.ListSpans):
            return p.SpansReply(spans=[self._span(msg.span_id).info()]) if msg.span_id else self.spans.table()
        if isinstance(msg, p.Stop):
            span = self._span(msg.job_id)
            if not _sees(who, span):
                raise FederationError(p.FORBIDDEN, f"{who.describe()} may not stop job {span.span_id}: only the key "
                                      "that submitted it, or an admin, may")
            text, out = self.spans.stop(span.span_id, now)
            self._send(out)
            return p.Ok(message=text)
        if isinstance(msg, p.Events):   # one job's, or every job's and the islands'
            spans = [self._span(msg.job_id)] if msg.job_id is not None else list(self.spans.spans.values())
            evs, more = events.select([(s.span_id, s.history) for s in spans if _sees(who, s)],
                                      None if msg.job_id is not None else self.state.events, msg.after)
            return p.EventsReply(events=evs, more=more)
        if isinstance(msg, p.Status):
            raise FederationError(p.UNEXPECTED, "a federation front has no island's job table: `elasticd islands "
                                  "--jobs` shows the jobs spanning its islands; ask an island's scheduler for its own")
        raise FederationError(p.UNEXPECTED, f"a federation front does not serve {msg.op}")


def _sees(who: principals.Principal, span: Span) -> bool:
    """Whether `who` may stop `span` or read its events: the key that submitted it, or an admin."""
    return who.admin or span.owner == who.owner
