"""The island scheduler's I/O loop: ROUTER sockets in, `SchedulerState` decisions out.

Everything that decides lives in `state.SchedulerState`; this loop only decodes frames, calls it,
persists the jobs it changed (before any reply or command leaves, so what a client was told survives
a crash), and sends the resulting messages. Any bad input gets a typed error reply and the loop goes
on; an unexpected exception while serving one message is logged and answered with `internal`.
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
from elasticd.daemon.statedir import StateDir, write_info
from elasticd.scheduler.state import Config, SchedulerError, SchedulerState, Send
from elasticd.scheduler.store import JobStore

log = logging.getLogger(__name__)

_BATCH = 256  # messages served per socket per loop turn, so one busy socket cannot starve the tick
FORWARD_TIMEOUT_S = 5.0


class SchedulerServer:
    """One island scheduler.

    `bind` is its TCP endpoint (CURVE, allow-list from the state dir) or None; `local` is an extra
    ipc:// or inproc:// endpoint without CURVE (the embedded scheduler's daemon, or local CLIs).

    Raises:
        transport.TransportError: if an endpoint cannot be bound.
    """

    def __init__(self, state_dir: StateDir, *, bind: str | None, local: str | None,
                 ctx: zmq.Context | None = None, config: Config | None = None,
                 allow_shutdown: bool = True) -> None:
        self.sd = state_dir.create()
        self.ctx = ctx or zmq.Context.instance()
        self.cfg = config or Config()
        self.allow_shutdown = allow_shutdown
        self.store = JobStore(self.sd.db)
        self.state = SchedulerState(self.store.load(), now=time.time(), config=self.cfg)
        self.identity = keys.ensure_identity(self.sd.root)
        self._stop = threading.Event()
        self._nodes: dict[str, tuple[zmq.Socket, bytes]] = {}
        # requests forwarded to a node: our rid -> (socket, requester identity, its rid, deadline)
        self._pending: dict[int, tuple[zmq.Socket, bytes, int, float]] = {}
        self._rid = 0
        self._auth = None
        self.sockets: list[zmq.Socket] = []
        self.tcp_endpoint: str | None = None
        self.local_endpoint: str | None = None
        self.served = 0
        self.errors = 0
        try:
            if bind:
                self.allow = transport.AllowList(self.sd.root)
                self._auth = transport.start_authenticator(self.ctx, self.allow)
                sock = transport.router(self.ctx)
                self.sockets.append(sock)   # before binding: close() must close it if the bind fails
                transport.curve_server(sock, self.identity)
                self.tcp_endpoint = transport.bind_tcp(sock, bind)
            if local:
                sock = transport.router(self.ctx)
                self.sockets.append(sock)
                if local.startswith("ipc://"):
                    self.local_endpoint = transport.bind_ipc(sock, Path(local[len("ipc://"):]))
                else:
                    sock.bind(local)
                    self.local_endpoint = local
        except Exception:
            self.close()
            raise
        log.info("scheduler serving tcp=%s local=%s state=%s jobs=%d", self.tcp_endpoint, self.local_endpoint,
                 self.sd.root, len(self.state.jobs))

    @property
    def public_key(self) -> str:
        return self.identity[0].decode()

    def write_info(self) -> None:
        write_info(self.sd.scheduler_info, {"pid": os.getpid(), "tcp": self.tcp_endpoint,
                                           "local": self.local_endpoint, "public_key": self.public_key})

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        poller = zmq.Poller()
        for s in self.sockets:
            poller.register(s, zmq.POLLIN)
        tick_every = min(0.5, self.cfg.heartbeat_s / 2)
        next_tick = time.monotonic()
        try:
            while not self._stop.is_set():
                wait = max(0.0, next_tick - time.monotonic())
                ready = dict(poller.poll(timeout=min(wait, 0.2) * 1000))
                for sock in self.sockets:
                    if sock in ready:
                        self._drain(sock)
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + tick_every
                    try:
                        self._execute(self.state.tick(time.time()))
                        self._expire()
                    except Exception:  # a bug in one tick must not take the island down
                        log.exception("scheduler tick failed")
        finally:
            self.close()

    def close(self) -> None:
        for s in self.sockets:
            s.close(linger=0)
        self.sockets = []
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.store.close()

    # --- serving ---------------------------------------------------------------------------------

    def _drain(self, sock: zmq.Socket) -> None:
        for _ in range(_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._serve(sock, frames)

    def _serve(self, sock: zmq.Socket, frames: list[bytes]) -> None:
        self.served += 1
        ident = frames[0]
        if len(frames) != 2:
            self._reply(sock, ident, p.Error(code=p.BAD_FRAME, message=f"expected 1 frame, got {len(frames) - 1}"))
            return
        try:
            msg = p.decode(frames[1])
        except p.ProtocolError as e:
            log.debug("bad frame from %r: %s", ident, e)
            self._reply(sock, ident, p.error_from(e, p.peek_rid(frames[1])))
            return
        try:
            reply, actions = self._dispatch(sock, ident, msg)
        except SchedulerError as e:
            reply, actions = p.Error(code=e.code, message=e.message), []
        except Exception as e:  # the server must outlive any one request
            log.exception("internal error serving %s", msg.op)
            reply, actions = p.Error(code=p.INTERNAL, message=f"{type(e).__name__}: {e}"), []
        self.store.save(self.state.take_dirty())
        if reply is not None:
            reply.rid = msg.rid
            self._reply(sock, ident, reply)
        self._execute(actions)

    def _reply(self, sock: zmq.Socket, ident: bytes, msg: p.Message) -> None:
        if isinstance(msg, p.Error):
            self.errors += 1
        transport.send(sock, msg, ident)

    def _dispatch(self, sock: zmq.Socket, ident: bytes, msg: p.Message) -> tuple[p.Message | None, list[Send]]:
        now = time.time()
        if isinstance(msg, p.NodeStatus):
            actions = self.state.node_status(msg, now)   # raises for a node that has not said hello
            self._nodes[msg.node_id] = (sock, ident)      # follow a node that reconnected
            return None, actions
        if isinstance(msg, p.NodeHello):
            self._nodes[msg.node_id] = (sock, ident)
            return None, self.state.node_hello(msg, now)
        if isinstance(msg, p.NodeBye):
            return p.Ok(), self.state.node_bye(msg.node_id, now)
        if isinstance(msg, p.Submit):
            job, actions = self.state.submit(msg, now)
            return p.Submitted(job_id=job.job_id), actions
        if isinstance(msg, p.Status):
            return self.state.status(msg.job_id, now), []
        if isinstance(msg, p.Stop):
            text, actions = self.state.stop(msg.job_id, now)
            return p.Ok(message=text), actions
        if isinstance(msg, p.Scale):
            text, actions = self.state.scale(msg.job_id, msg.devices, now)
            return p.Ok(message=text), actions
        if isinstance(msg, p.Drain):
            text, actions = self.state.drain(msg.node_id, msg.deadline_s, now)
            return p.Ok(message=text), actions
        if isinstance(msg, p.Undrain):
            text, actions = self.state.undrain(msg.node_id, now)
            return p.Ok(message=text), actions
        if isinstance(msg, p.Logs):
            return self._forward_logs(sock, ident, msg), []
        if isinstance(msg, p.LogsReply):
            pending = self._pending.pop(msg.rid, None)
            if pending is None:
                return p.Error(code=p.UNEXPECTED, message="no request is waiting for this reply (late?)"), []
            psock, pident, prid, _ = pending
            msg.rid = prid
            self._reply(psock, pident, msg)
            return None, []
        if isinstance(msg, p.Shutdown) and self.allow_shutdown:
            log.info("shutdown requested")
            self._stop.set()
            return p.Ok(message="scheduler shutting down"), []
        return p.Error(code=p.UNEXPECTED, message=f"the scheduler does not serve {msg.op!r}"), []

    def _forward_logs(self, sock: zmq.Socket, ident: bytes, msg: p.Logs) -> p.Message | None:
        """Ask the node holding the logs; its reply is relayed back under the requester's rid."""
        route = self._nodes.get(msg.node_id)
        nd = self.state.nodes.get(msg.node_id)
        if route is None or nd is None or not nd.alive:
            return p.Error(code=p.UNKNOWN_NODE, message=f"node {msg.node_id!r} is not connected")
        self._rid += 1
        self._pending[self._rid] = (sock, ident, msg.rid, time.monotonic() + FORWARD_TIMEOUT_S)
        fwd = p.Logs(job_id=msg.job_id, node_id=msg.node_id, offsets=msg.offsets, max_bytes=msg.max_bytes,
                     rid=self._rid)
        if not transport.send(route[0], fwd, route[1]):
            self._pending.pop(self._rid, None)
            return p.Error(code=p.UNKNOWN_NODE, message=f"node {msg.node_id!r} is not reachable")
        return None

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, v in self._pending.items() if v[3] < now]:
            sock, ident, prid, _ = self._pending.pop(rid)
            self._reply(sock, ident, p.Error(code=p.SCHEDULER_UNREACHABLE, rid=prid,
                                             message=f"no answer from the node within {FORWARD_TIMEOUT_S:.0f}s"))

    def _execute(self, actions: list[Send]) -> None:
        self.store.save(self.state.take_dirty())
        for a in actions:
            route = self._nodes.get(a.node_id)
            if route is None or not transport.send(route[0], a.msg, route[1]):
                log.debug("dropped %s for node %s (not connected)", a.msg.op, a.node_id)
