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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import zmq

from elasticd import keys, transport
from elasticd import protocol as p
from elasticd.placement.speeds import Speeds
from elasticd.scheduler import admission, authz
from elasticd.scheduler.federation_link import FederationLink
from elasticd.scheduler.state import Config, SchedulerError, SchedulerState, SendToNode
from elasticd.scheduler.store import JobStore
from elasticd.scheduler.watch import Watcher
from elasticd.statedir import StateDir, write_info

log = logging.getLogger(__name__)

_BATCH = 256  # messages served per socket per loop turn, so one busy socket cannot starve the tick
_NODE_OPS = frozenset({p.NodeStatus.op, p.NodeHello.op, p.NodeBye.op})
FORWARD_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class Federation:
    """Where an island scheduler reports to: a federation front's endpoint and key, and its island id."""

    endpoint: str
    server_key: bytes
    island_id: str


class SchedulerServer:
    """One island scheduler.

    `bind` is its TCP endpoint (CURVE, allow-list from the state dir) or None; `local` is an extra
    ipc:// or inproc:// endpoint without CURVE (the embedded scheduler's daemon, or local CLIs);
    `watch` makes what is told of every request, heartbeat and tick (elasticd.observe's metrics and
    status page); the server closes it.

    Raises:
        transport.TransportError: if an endpoint cannot be bound.
        OSError: if `watch` cannot bind its address.
    """

    def __init__(self, state_dir: StateDir, *, bind: str | None, local: str | None,
                 ctx: zmq.Context | None = None, config: Config | None = None,
                 allow_shutdown: bool = True, limits: admission.Limits | None = None,
                 watch: Callable[[], Watcher] | None = None, federation: Federation | None = None) -> None:
        self.sd = state_dir.create()
        self.ctx = ctx or zmq.Context.instance()
        self.cfg = config or Config()
        self.limits = limits or admission.Limits()
        self.allow_shutdown = allow_shutdown
        self.store = JobStore(self.sd.db)
        self.state = SchedulerState(self.store.load(), now=time.time(), config=self.cfg,
                                    speeds=_load_speeds(self.store))
        self.state.bump_seq(self.store.next_seq())
        self._next_purge = 0.0
        self.identity = keys.ensure_identity(self.sd.root)
        self._stop = threading.Event()
        self._nodes: dict[str, tuple[zmq.Socket, bytes]] = {}
        # requests forwarded to a node: our rid -> (socket, requester identity, its rid, deadline)
        self._pending: dict[int, tuple[zmq.Socket, bytes, int, float]] = {}
        self._forwarded_to: dict[int, str] = {}   # our rid -> the node asked (no other node may answer)
        self._rid = 0
        self._auth = None
        self.sockets: list[zmq.Socket] = []
        self.tcp_endpoint: str | None = None
        self.local_endpoint: str | None = None
        self.served = 0
        self.errors = 0
        self.allow: transport.AllowList | None = None
        self._tcp: zmq.Socket | None = None
        self._budget = admission.KeyBudget()   # requests per second of each client and admin key
        self._refused = authz.Refusals(log)
        self.watch: Watcher | None = None
        self.federation: FederationLink | None = None
        try:
            if watch is not None:
                self.watch = watch()
            if federation is not None:
                self.federation = FederationLink(self.ctx, self.identity, federation.endpoint, federation.server_key,
                                                 federation.island_id, self.cfg.heartbeat_s)
            if bind:
                transport.raise_fd_limit()
                self.allow = transport.AllowList(self.sd.root)
                self._auth = transport.start_authenticator(self.ctx, self.allow)
                sock = transport.router(self.ctx)
                self.sockets.append(sock)   # before binding: close() must close it if the bind fails
                transport.curve_server(sock, self.identity)
                self.tcp_endpoint = transport.bind_tcp(sock, bind)
                self._tcp = sock
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
                                           "local": self.local_endpoint, "public_key": self.public_key,
                                           "metrics": self.metrics_url})

    @property
    def metrics_url(self) -> str | None:
        return self.watch.url if self.watch is not None else None

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        poller = zmq.Poller()
        for s in self.sockets:
            poller.register(s, zmq.POLLIN)
        if self.federation is not None:
            poller.register(self.federation.sock, zmq.POLLIN)
        tick_every = min(0.5, self.cfg.heartbeat_s / 2)
        next_tick = time.monotonic()
        try:
            while not self._stop.is_set():
                wait = max(0.0, next_tick - time.monotonic())
                ready = dict(poller.poll(timeout=min(wait, 0.2) * 1000))
                for sock in self.sockets:
                    if sock in ready:
                        self._drain(sock)
                if self.federation is not None and self.federation.sock in ready:
                    self._from_front(self.federation.readable())
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + tick_every
                    try:
                        self._execute(self.state.tick(time.time()))
                        self._expire()
                        self._purge(time.time())
                        if self.watch is not None:
                            self.watch.refresh(self.state)
                        if self.federation is not None:
                            self.federation.beat(self.state, time.monotonic())
                    except Exception:  # a bug in one tick must not take the island down
                        log.exception("scheduler tick failed")
        finally:
            self.close()

    def close(self) -> None:
        if self.federation is not None:
            self.federation.close()
            self.federation = None
        try:
            if self.state.speeds.dirty:
                self.store.save_speeds(self.state.speeds.to_dict())
        except Exception:  # closing must go on; the speeds are learned again
            log.exception("could not save device speeds")
        if self.watch is not None:
            self.watch.close()
            self.watch = None
        for s in self.sockets:
            s.close(linger=0)
        self.sockets = []
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        self.store.close()

    # --- serving ---------------------------------------------------------------------------------

    def _drain(self, sock: zmq.Socket) -> None:
        batch = []
        for _ in range(_BATCH):
            got = transport.recv_request(sock)
            if got is None:
                break
            batch.append(got)
        # Nodes' own messages first: a heartbeat must not wait behind the client requests that came before
        # it, or a flood of `status` would get its node declared lost.
        batch.sort(key=lambda got: p.peek_op(got[1]) not in _NODE_OPS)
        for ident, payload, extra, user_id in batch:
            if self.watch is None:
                self._serve(sock, ident, payload, extra, user_id)
                continue
            t0 = time.perf_counter()
            op = self._serve(sock, ident, payload, extra, user_id)
            self.watch.request(op, time.perf_counter() - t0)

    def _serve(self, sock: zmq.Socket, ident: bytes, payload: bytes, extra: int = 0,
               user_id: str | None = None) -> str:
        """Serve one frame; returns its op ("invalid" for a frame that did not decode), for the metrics."""
        self.served += 1
        if extra:
            self._reply(sock, ident, p.Error(code=p.BAD_FRAME, message=f"expected 1 frame, got {extra + 1}"))
            return "invalid"
        try:
            msg = p.decode(payload)
        except p.ProtocolError as e:
            log.debug("bad frame from %r: %s", ident, e)
            self._reply(sock, ident, p.error_from(e, p.peek_rid(payload)))
            return "invalid"
        who = authz.peer(user_id, self.allow, local=sock is not self._tcp)
        if who is None:   # its key left the allow-list after the handshake
            self._reply(sock, ident, p.Error(code=p.FORBIDDEN, rid=msg.rid,
                                             message="this key is no longer on the allow-list"))
            return msg.op
        if (busy := self._budget.busy(who, keys.NODE, time.monotonic())) is not None:
            self._reply(sock, ident, p.Error(code=p.BUSY, rid=msg.rid, message=busy))
            return msg.op
        try:
            why = authz.check(who, msg, self._owner_of(msg))
            if why is not None:
                self._refused(who, msg, why, str(getattr(msg, "node_id", "")))
                raise SchedulerError(p.FORBIDDEN, why)
            reply, actions = self._dispatch(sock, ident, msg, who)
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
        return msg.op

    def _from_front(self, commands: list[p.Message]) -> None:
        for msg in commands:
            try:
                actions = self.state.portions.apply(msg, time.time())
            except Exception:  # the island must outlive any one command
                log.exception("internal error applying %s from the federation front", msg.op)
                continue
            self._execute(actions)

    def _reply(self, sock: zmq.Socket, ident: bytes, msg: p.Message) -> None:
        if isinstance(msg, p.Error):
            self.errors += 1
        transport.send(sock, msg, ident)

    def _owner_of(self, msg: p.Message) -> str | None:
        job_id = getattr(msg, "job_id", None)
        job = self.state.jobs.get(job_id) if isinstance(job_id, str) else None
        return job.spec.owner if job is not None else None

    def _dispatch(self, sock: zmq.Socket, ident: bytes, msg: p.Message,
                  who: authz.Principal = authz.LOCAL) -> tuple[p.Message | None, list[SendToNode]]:
        now = time.time()
        if isinstance(msg, p.NodeStatus):
            actions = self.state.node_status(msg, now)   # raises for a node that has not said hello
            if self.watch is not None:
                self.watch.heartbeat()
            self._nodes[msg.node_id] = (sock, ident)      # follow a node that reconnected
            return None, actions
        if isinstance(msg, p.NodeHello):
            self._nodes[msg.node_id] = (sock, ident)
            return None, self.state.node_hello(msg, now)
        if isinstance(msg, p.NodeBye):
            return p.Ok(), self.state.node_bye(msg.node_id, now)
        if isinstance(msg, p.Submit):
            admission.check_quota(self.state.jobs.values(), who.owner, self.limits)
            admission.check_fits(self.state.nodes.values(), msg.min_devices, "--min-devices asks for")
            job, actions = self.state.submit(msg, now, owner=who.owner, run_as=authz.run_as(who, msg))
            return p.Submitted(job_id=job.job_id), actions
        if isinstance(msg, p.Status):
            reply = self.state.status(msg.job_id, now) if msg.job_id is not None else self._status_page(msg.after, now)
            if not authz.sees_all_jobs(who):
                for info in reply.jobs:
                    job = self.state.jobs.get(info.job_id)
                    if job is not None and job.spec.owner != who.owner:
                        info.error = authz.redacted(info.error)
            return reply, []
        if isinstance(msg, p.Events):
            return self.state.events(msg.job_id, msg.after, None if authz.sees_all_jobs(who) else who.owner), []
        if isinstance(msg, p.Stop):
            text, actions = self.state.stop(msg.job_id, now)
            return p.Ok(message=text), actions
        if isinstance(msg, p.Scale):
            job = self.state.jobs.get(msg.job_id)
            if job is not None and msg.devices <= job.spec.workers:   # beyond N gets its own error
                admission.check_fits(self.state.nodes.values(), msg.devices, f"scale of {msg.job_id} asks for")
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
            pending = self._pending.get(msg.rid)
            if pending is None or self._forwarded_to.get(msg.rid) != msg.node_id:   # only the node asked answers
                return p.Error(code=p.UNEXPECTED, message="no request is waiting for this reply (late?)"), []
            self._pending.pop(msg.rid)
            self._forwarded_to.pop(msg.rid, None)
            psock, pident, prid, _ = pending
            msg.rid = prid
            self._reply(psock, pident, msg)
            return None, []
        if isinstance(msg, p.Shutdown) and self.allow_shutdown:
            log.info("shutdown requested")
            self._stop.set()
            return p.Ok(message="scheduler shutting down"), []
        if isinstance(msg, (p.ReservePortion, p.StartPortion, p.CancelPortion, p.MovePortion, p.GoPortion,
                            p.AbortPortionMove)):
            return p.Error(code=p.UNEXPECTED, message=f"{msg.op} is taken only from the federation front this "
                           "island joined, on its own connection to it"), []
        return p.Error(code=p.UNEXPECTED, message=f"the scheduler does not serve {msg.op!r}"), []

    def _status_page(self, after: int, now: float) -> p.StatusReply:
        """The job list one page at a time: whatever the table holds, every reply fits in a frame."""
        nodes = self.state.node_infos(now)
        jobs, next_after = admission.page(self.state.job_infos(after))
        return p.StatusReply(jobs=jobs, nodes=nodes, next_after=next_after)

    def _forward_logs(self, sock: zmq.Socket, ident: bytes, msg: p.Logs) -> p.Message | None:
        """Ask the node holding the logs; its reply is relayed back under the requester's rid."""
        route = self._nodes.get(msg.node_id)
        nd = self.state.nodes.get(msg.node_id)
        if route is None or nd is None or not nd.alive:
            return p.Error(code=p.UNKNOWN_NODE, message=f"node {msg.node_id!r} is not connected")
        self._rid += 1
        self._pending[self._rid] = (sock, ident, msg.rid, time.monotonic() + FORWARD_TIMEOUT_S)
        self._forwarded_to[self._rid] = msg.node_id
        fwd = p.Logs(job_id=msg.job_id, node_id=msg.node_id, offsets=msg.offsets, max_bytes=msg.max_bytes,
                     rid=self._rid)
        if not transport.send(route[0], fwd, route[1]):
            self._pending.pop(self._rid, None)
            self._forwarded_to.pop(self._rid, None)
            return p.Error(code=p.UNKNOWN_NODE, message=f"node {msg.node_id!r} is not reachable")
        return None

    def _purge(self, now: float, every_s: float = 5.0) -> None:
        if now < self._next_purge:
            return
        self._next_purge = now + every_s
        for job in admission.scrub(self.state.jobs.values()):
            job.spec.env = {}
            self.state.changed(job)
        self.store.save(self.state.take_dirty())
        if self.state.speeds.dirty:   # learned on every heartbeat: written at this pace, not per message
            self.state.speeds.dirty = False
            self.store.save_speeds(self.state.speeds.to_dict())
        gone = self.state.purge(admission.expired(self.state.jobs.values(), now, self.limits))
        if gone:
            self.store.delete(gone, self.state.next_seq)
            log.info("purged %d ended job(s) past retention: %s%s", len(gone), ",".join(gone[:10]),
                     "..." if len(gone) > 10 else "")

    def _expire(self) -> None:
        now = time.monotonic()
        for rid in [r for r, v in self._pending.items() if v[3] < now]:
            sock, ident, prid, _ = self._pending.pop(rid)
            self._forwarded_to.pop(rid, None)
            self._reply(sock, ident, p.Error(code=p.SCHEDULER_UNREACHABLE, rid=prid,
                                             message=f"no answer from the node within {FORWARD_TIMEOUT_S:.0f}s"))

    def _execute(self, actions: list[SendToNode]) -> None:
        self.store.save(self.state.take_dirty())
        for a in actions:
            route = self._nodes.get(a.node_id)
            if route is None or not transport.send(route[0], a.msg, route[1]):
                log.debug("dropped %s for node %s (not connected)", a.msg.op, a.node_id)


def _load_speeds(store: JobStore) -> Speeds:
    try:
        return Speeds.from_dict(store.load_speeds())
    except Exception as e:  # a model we cannot read is learned again, never a scheduler that will not start
        log.error("ignoring saved device speeds: %s", e)
        return Speeds()
