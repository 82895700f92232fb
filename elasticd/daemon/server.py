"""The node daemon's I/O loop: the CLI socket, the agents' socket and the link to the scheduler.

One thread serves all three (plus the embedded scheduler in its own thread, when there is one).
CLI requests about jobs are relayed to the scheduler under a fresh request id and the reply is
relayed back; `logs` and `shutdown` are answered here. The scheduler sees this node through
`NodeHello` and then a `NodeStatus` heartbeat carrying the full state of the node's jobs.
"""

from __future__ import annotations

import fcntl
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
from elasticd.core.errors import ControlPlaneError
from elasticd.daemon import devices as devices_mod
from elasticd.daemon import job_user
from elasticd.daemon.grace import GraceDrain
from elasticd.daemon.job_user import JobUserError
from elasticd.daemon.processes import AgentProcesses, open_agent_root
from elasticd.observe.serving import watch_at
from elasticd.scheduler.admission import Limits
from elasticd.scheduler.server import SchedulerServer
from elasticd.scheduler.state import Config
from elasticd.scheduler.store import StoreError
from elasticd.statedir import (
    StateDir,
    UnsafeStateDir,
    default_node_id,
    read_info,
    write_info,
)

log = logging.getLogger(__name__)

_RELAYED = (p.Submit, p.Status, p.Stop, p.Scale, p.Drain, p.Undrain, p.Events)
_BATCH = 256
# Requests relayed to the scheduler and not answered yet, per CLI connection and in all. The scheduler serves
# this node's heartbeats on the same link: however many requests local clients fire, at most MAX_IN_FLIGHT
# wait ahead of a heartbeat, and the rest are answered `busy` at once.
MAX_IN_FLIGHT_PER_PEER = 8
MAX_IN_FLIGHT = 64
MAX_LOG_REPLY = 512 * 1024
HELLO_WAIT_S = 60.0   # the longest a node waits for its spares' fork server before offering its devices


class DaemonError(ControlPlaneError, RuntimeError):
    """The daemon cannot start (state dir in use, endpoint not bindable, bad key)."""


@dataclass(slots=True)
class DaemonConfig:
    state_dir: StateDir
    cpu_devices: int | None = None
    cuda_devices: int | None = None        # serve cuda:0..N-1 without probing (elasticd run's node)
    scheduler: str | None = None           # tcp:// endpoint of a standalone scheduler; None = embedded
    scheduler_key: bytes | None = None     # its public key (CURVE)
    bind: str | None = None                # the embedded scheduler's TCP endpoint; None = IPC only
    host: str = "127.0.0.1"                # address other nodes' agents reach this node's agents on
    node_id: str | None = None
    heartbeat_s: float = 1.0
    node_timeout_s: float = 10.0
    request_timeout_s: float = 5.0
    agent_command: list[str] | None = None
    limits: Limits | None = None           # the embedded scheduler's retention and quotas
    spares: int | None = None              # at most this many warm spare agents, one per idle device and
                                           # at least one (elasticd/daemon/spares.py); None: no cap
    drain_grace_s: float = 0.0             # SIGTERM drains the node for up to this long (elasticd/daemon/grace.py)
    metrics: tuple[str, int] | None = None  # the embedded scheduler's metrics and status page (elasticd.observe)
    device_speed: str | None = None        # declared relative device speeds (devices.parse_speeds)
    relayout: bool = True                  # the embedded scheduler's live re-layouts
    pin_cpus: bool = False                 # CPU agents bound to a block of cores each (agent/cpu_pin.py)
    jobs_as: str | None = None             # the user jobs run as unless their key names one (elasticd/daemon/job_user.py)
    inherit_output: bool = False           # agents write to this process's stdout/stderr (`elasticd run`), not to logs
    pin_by_rank: bool = False              # CPU agents pinned to blocks re-cut by rank at each resize (`elasticd run`)




def lock_state_dir(sd: StateDir, what: str) -> int:
    """Hold the state dir's lock for the life of the process.

    Raises:
        DaemonError: if another daemon or scheduler holds it.
    """
    sd.create()
    try:
        fd = os.open(sd.lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError as e:   # ELOOP: a symlink planted where we would truncate and write
        raise DaemonError(f"cannot open {sd.lock} without following links: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        other = read_info(sd.daemon_info) or read_info(sd.scheduler_info) or {}
        raise DaemonError(f"{sd.root} is in use by another elasticd process (pid {other.get('pid', '?')})") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()} {what}\n".encode())
    return fd


class NodeDaemon:
    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        self.sd = cfg.state_dir
        self._lock_fd = lock_state_dir(self.sd, "daemon")
        self._stop = threading.Event()
        self.ctx = zmq.Context()
        self.ctx.max_sockets = 4096
        self.node_id = cfg.node_id or default_node_id(self.sd)
        self.scheduler: SchedulerServer | None = None
        self._sched_thread: threading.Thread | None = None
        self._pending: dict[int, tuple[bytes, int, float]] = {}   # link rid -> (cli identity, cli rid, deadline)
        self._rid = 0
        self._welcomed = False
        self._last_ack = 0.0
        self._seq = 0
        self._next_beat = 0.0
        self._push = False
        self._last_error: tuple[str, str] | None = None
        self._started = time.time()
        self._said_warming = False
        self.heartbeat_s = cfg.heartbeat_s
        self.grace = GraceDrain(cfg.drain_grace_s)
        self._term = threading.Event()
        self._drain_rid = -1
        self.cli: zmq.Socket | None = None
        self.agents: zmq.Socket | None = None
        self.link: zmq.Socket | None = None
        try:
            self.identity = keys.ensure_identity(self.sd.root)
            try:
                found = (devices_mod.cuda_devices(cfg.cuda_devices) if cfg.cuda_devices is not None
                         else devices_mod.discover(cfg.cpu_devices))
                self.devices = devices_mod.with_speeds(found, cfg.device_speed)
            except ValueError as e:
                raise DaemonError(str(e)) from None
            self.cli = transport.router(self.ctx)
            self.cli_endpoint = transport.bind_ipc(self.cli, self.sd.daemon_sock)
            self.jobs_as = job_user.node_default(cfg.jobs_as)
            # As root, jobs run as other users: they pass through the agents' area to their own job's
            # directory and the agent socket, where each agent proves itself with its own token.
            shared = job_user.can_switch()
            open_agent_root(self.sd, shared, time.time())
            self.agents = transport.router(self.ctx)
            self.agents_endpoint = transport.bind_ipc(self.agents, self.sd.agents_sock, shared=shared)
            self.link = transport.dealer(self.ctx)
            if cfg.scheduler is None:
                local = f"inproc://elasticd-scheduler-{id(self)}"
                self.scheduler = SchedulerServer(
                    self.sd, bind=cfg.bind, local=local, ctx=self.ctx, allow_shutdown=False, limits=cfg.limits,
                    config=Config(heartbeat_s=cfg.heartbeat_s, node_timeout_s=cfg.node_timeout_s,
                                  relayout_enabled=cfg.relayout),
                    watch=watch_at(cfg.metrics))
                self.link_endpoint = local
            else:
                if not transport.is_tcp(cfg.scheduler):
                    raise DaemonError(f"--scheduler must be a tcp:// endpoint, got {cfg.scheduler!r}")
                if cfg.scheduler_key is None:
                    raise DaemonError("--scheduler needs --scheduler-key (the scheduler's public key)")
                transport.curve_client(self.link, self.identity, cfg.scheduler_key)
                self.link_endpoint = cfg.scheduler
            self.link.connect(self.link_endpoint)
        except (transport.TransportError, keys.BadKeyError, zmq.ZMQError, StoreError, UnsafeStateDir, JobUserError,
                OSError) as e:
            self._close()
            raise DaemonError(str(e)) from e
        except BaseException:
            self._close()
            raise
        keep = (cfg.limits or Limits()).job_retention_s   # a job's logs go when the scheduler purges the job
        self.sup = AgentProcesses(self.sd, self.devices, self.agents_endpoint, cfg.host, cfg.agent_command,
                                  spares=cfg.spares, pin_cpus=cfg.pin_cpus, log_keep_s=keep, jobs_as=self.jobs_as,
                                  inherit_output=cfg.inherit_output, pin_by_rank=cfg.pin_by_rank)

    # --- lifecycle -------------------------------------------------------------------------------

    def info(self) -> dict[str, object]:
        return {"pid": os.getpid(), "node_id": self.node_id, "cli": self.cli_endpoint,
                "agents": self.agents_endpoint, "scheduler": self.link_endpoint,
                "scheduler_tcp": self.scheduler.tcp_endpoint if self.scheduler else None,
                "metrics": self.scheduler.metrics_url if self.scheduler else None,
                "public_key": self.identity[0].decode(), "host": self.cfg.host, "jobs_as": self.jobs_as.name,
                "devices": [d.device_id for d in self.devices]}

    def stop(self) -> None:
        self._stop.set()

    def terminate(self) -> None:
        """SIGTERM (from a signal handler): drain first when started with a grace period, else stop."""
        self._term.set()

    def _graceful(self, now: float) -> None:
        if self._term.is_set():
            self._term.clear()
            if self.grace.terminate(now):
                self._stop.set()
                return
            log.info("node %s: SIGTERM, draining for up to %.0fs before exiting", self.node_id, self.grace.grace_s)
        if self.grace.must_ask(self._welcomed):
            self._rid += 1
            self._drain_rid = self._rid
            transport.send(self.link, p.Drain(node_id=self.node_id, deadline_s=self.grace.left(now), rid=self._rid))
        if self.grace.done(now, self.sup.live_agents(), self._welcomed):
            self._stop.set()

    def run(self) -> None:
        if self.scheduler is not None:
            self._sched_thread = threading.Thread(target=self.scheduler.run, name="elasticd-scheduler", daemon=True)
            self._sched_thread.start()
        write_info(self.sd.daemon_info, self.info())
        log.info("node %s serving %s with devices %s; scheduler %s", self.node_id, self.cli_endpoint,
                 ",".join(d.device_id for d in self.devices), self.link_endpoint)
        poller = zmq.Poller()
        for s in (self.cli, self.agents, self.link):
            poller.register(s, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(timeout=50))
                now = time.time()
                if self.link in ready:
                    self._drain(self.link, self._from_scheduler)
                if self.agents in ready:
                    self._drain(self.agents, self._from_agent)
                if self.cli in ready:
                    self._drain(self.cli, self._from_cli)
                try:
                    self._push |= self.sup.poll(now)
                    self._heartbeat(now)
                    self._expire(now)
                    self._graceful(now)
                except Exception:  # keep serving; the next turn retries
                    log.exception("daemon housekeeping failed")
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        log.info("node %s shutting down (%d agents running)", self.node_id, self.sup.live_agents())
        self.sup.shutdown()
        if self._welcomed and self.link is not None:
            transport.send(self.link, p.NodeBye(node_id=self.node_id))
            if self.link.poll(500):   # the scheduler's Ok: it has failed our jobs before we go
                try:
                    self.link.recv_multipart(zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        if self.scheduler is not None:
            self.scheduler.stop()
            if self._sched_thread is not None:
                self._sched_thread.join(timeout=5.0)
        self._close()

    def _close(self) -> None:
        for s in (self.cli, self.agents, self.link):
            if s is not None:
                s.close(linger=0)
        if self.scheduler is not None and self._sched_thread is None:
            self.scheduler.close()
        self.ctx.term()
        # We still hold the state dir's lock, so these files are ours (or a crashed predecessor's).
        for path in (self.sd.daemon_sock, self.sd.agents_sock):
            path.unlink(missing_ok=True)
        try:
            self.sd.agent_root.rmdir()   # emptied by the agents' shutdown; kept if a job's files are left
        except OSError:
            pass
        info = read_info(self.sd.daemon_info)
        if info is not None and info.get("pid") == os.getpid():
            self.sd.daemon_info.unlink(missing_ok=True)
        os.close(self._lock_fd)

    # --- sockets ---------------------------------------------------------------------------------

    def _drain(self, sock: zmq.Socket, handle) -> None:
        for _ in range(_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                handle(frames)
            except Exception:  # the daemon must outlive any one message
                log.exception("internal error handling a message")
                if sock is not self.link and len(frames) >= 1:
                    transport.send(sock, p.Error(code=p.INTERNAL, message="internal error"), frames[0])

    def _decode(self, sock: zmq.Socket, frames: list[bytes],
                on_bad: Callable[[str], None] | None = None) -> p.Message | None:
        """Decode a ROUTER frame pair, answering the sender with a typed error when it is bad (and telling
        `on_bad` why)."""
        if len(frames) != 2:
            transport.send(sock, p.Error(code=p.BAD_FRAME, message=f"expected 1 frame, got {len(frames) - 1}"),
                           frames[0])
            if on_bad is not None:
                on_bad(f"expected 1 frame, got {len(frames) - 1}")
            return None
        try:
            return p.decode(frames[1])
        except p.ProtocolError as e:
            if e.code == p.VERSION_MISMATCH:
                log.warning("refused a peer: %s", e.message)
            transport.send(sock, p.error_from(e, p.peek_rid(frames[1])), frames[0])
            if on_bad is not None:
                on_bad(e.message)
            return None

    def _from_cli(self, frames: list[bytes]) -> None:
        msg = self._decode(self.cli, frames)
        if msg is None:
            return
        ident = frames[0]
        if isinstance(msg, _RELAYED):
            self._relay(ident, msg)
        elif isinstance(msg, p.Logs) and msg.node_id not in ("", self.node_id):
            self._relay(ident, msg)
        elif isinstance(msg, p.Logs):
            self._reply(ident, self._logs(msg), msg.rid)
        elif isinstance(msg, p.Shutdown):
            self._reply(ident, p.Ok(message=f"node {self.node_id} shutting down"), msg.rid)
            self._stop.set()
        else:
            self._reply(ident, p.Error(code=p.UNEXPECTED, message=f"the daemon does not serve {msg.op!r}"), msg.rid)

    def _reply(self, ident: bytes, msg: p.Message, rid: int) -> None:
        msg.rid = rid
        transport.send(self.cli, msg, ident)

    def _relay(self, ident: bytes, msg: p.Message) -> None:
        mine = sum(1 for i, _c, _d in self._pending.values() if i == ident)
        if mine >= MAX_IN_FLIGHT_PER_PEER or len(self._pending) >= MAX_IN_FLIGHT:
            why = (f"{MAX_IN_FLIGHT_PER_PEER} requests of this client are still waiting for the scheduler"
                   if mine >= MAX_IN_FLIGHT_PER_PEER else f"{MAX_IN_FLIGHT} requests are waiting for the scheduler")
            self._reply(ident, p.Error(code=p.BUSY, message=f"busy: {why}; send more once they are answered"),
                        msg.rid)
            return
        self._rid += 1
        cli_rid, msg.rid = msg.rid, self._rid
        if not transport.send(self.link, msg):
            self._reply(ident, p.Error(code=p.SCHEDULER_UNREACHABLE,
                                       message=f"cannot reach the scheduler at {self.link_endpoint}"), cli_rid)
            return
        self._pending[self._rid] = (ident, cli_rid, time.monotonic() + self.cfg.request_timeout_s)

    def _expire(self, now: float) -> None:
        mono = time.monotonic()
        for rid in [r for r, (_i, _c, deadline) in self._pending.items() if deadline < mono]:
            ident, cli_rid, _ = self._pending.pop(rid)
            self._reply(ident, p.Error(code=p.SCHEDULER_UNREACHABLE,
                                       message=f"the scheduler at {self.link_endpoint} did not answer within "
                                               f"{self.cfg.request_timeout_s:.0f}s"), cli_rid)

    def _from_agent(self, frames: list[bytes]) -> None:
        msg = self._decode(self.agents, frames, on_bad=lambda why: self.sup.unreadable(frames[0], why, time.time()))
        if msg is None:
            return
        err = self.sup.agent_message(frames[0], msg, time.time())
        if err is not None:
            transport.send(self.agents, p.Error(code=p.BAD_REQUEST, message=err, rid=msg.rid), frames[0])
        elif isinstance(msg, p.AgentHello | p.AgentDone | p.AgentFailed | p.AgentResized | p.AgentResizeRefused
                        ) or self.sup.changed:
            # Events the scheduler acts on (a joiner ready, a resize done, an agent ended) go out now,
            # not at the next heartbeat: a resize waits on them.
            self.sup.changed = False
            self._push = True

    def _from_scheduler(self, frames: list[bytes]) -> None:
        if len(frames) != 1:
            log.warning("dropped a %d-frame message from the scheduler", len(frames))
            return
        try:
            msg = p.decode(frames[0])
        except p.ProtocolError as e:
            log.error("bad message from the scheduler: %s", e)
            return
        if isinstance(msg, p.Logs):   # a request from another node's CLI, via the scheduler
            reply = self._logs(msg)
            reply.rid = msg.rid
            transport.send(self.link, reply)
            return
        pending = self._pending.pop(msg.rid, None) if msg.rid else None
        if pending is not None:
            self._reply(pending[0], msg, pending[1])
            return
        now = time.time()
        if isinstance(msg, p.Ok | p.Error) and self.grace.draining and msg.rid == self._drain_rid:
            log.log(logging.INFO if isinstance(msg, p.Ok) else logging.WARNING, "drain of this node: %s", msg.message)
            return
        if isinstance(msg, p.Welcome):
            # The scheduler owns the node timeout, so it sets the pace of heartbeats.
            self.heartbeat_s = min(max(msg.heartbeat_s, 0.01), 60.0)
            log.info("scheduler %s welcomed node %s (heartbeat %.2fs)", self.link_endpoint, self.node_id,
                     self.heartbeat_s)
            self._welcomed, self._last_ack, self._push = True, now, True
            self.grace.asked = False   # a scheduler that (re)welcomes this node may not know of its drain
        elif isinstance(msg, p.NodeAck):
            self._last_ack = now
            self.grace.drained = msg.drained
            self.sup.forget(msg.forget)
        elif isinstance(msg, p.LaunchJob):
            self.sup.launch(msg, now)
            self._push = True
        elif isinstance(msg, p.KillJob):
            for ident, cmd in self.sup.kill(msg.job_id, msg.reason or "killed by the scheduler", now,
                                            graceful=not msg.force):
                transport.send(self.agents, cmd, ident)
        elif isinstance(msg, p.PrepareResize):
            self.sup.prepare(msg, now)
            self._push = True
        elif isinstance(msg, p.ResizeJob):
            for ident, cmd in self.sup.go(msg):
                transport.send(self.agents, cmd, ident)
            self._push = True
        elif isinstance(msg, p.AbortResize):
            self.sup.abort(msg, now)
            self._push = True
        elif isinstance(msg, p.Error):
            if msg.code == p.UNKNOWN_NODE:
                log.info("scheduler does not know node %s (restarted?); saying hello again", self.node_id)
                self._welcomed = False
                self._next_beat = 0.0
            elif (msg.code, msg.message) != self._last_error:   # a refused hello repeats every heartbeat
                self._last_error = (msg.code, msg.message)
                log.warning("scheduler error: %s: %s", msg.code, msg.message)

    def _heartbeat(self, now: float) -> None:
        if not (self._push and self._welcomed) and now < self._next_beat:
            return
        self._push = False
        self._next_beat = now + self.heartbeat_s
        if self._welcomed and now - self._last_ack > self.cfg.node_timeout_s:
            log.warning("no answer from the scheduler at %s for %.0fs; saying hello again",
                        self.link_endpoint, now - self._last_ack)
            self._welcomed = False
        if self._welcomed:
            self._seq += 1
            transport.send(self.link, p.NodeStatus(node_id=self.node_id, seq=self._seq, jobs=self.sup.reports()))
        elif self._warm_enough(now):
            transport.send(self.link, p.NodeHello(node_id=self.node_id, host=self.cfg.host, devices=self.devices,
                                                  pid=os.getpid(), jobs=self.sup.reports()))

    def _warm_enough(self, now: float) -> bool:
        """Whether to offer this node's devices yet: not while the spares' fork server imports torch (for at
        most HELLO_WAIT_S after start). A job placed meanwhile would start each agent cold, every one importing
        torch beside the server: seconds of CPU per agent, and on a small node a later first step than
        waiting the server's import out and forking them."""
        if not self.sup.spares.warming() or now - self._started > HELLO_WAIT_S:
            return True
        if not self._said_warming:
            self._said_warming = True
            log.info("node %s: offering its devices once the spares' fork server has imported torch (at most "
                     "%.0fs)", self.node_id, HELLO_WAIT_S)
        return False

    # --- logs ------------------------------------------------------------------------------------

    def _logs(self, msg: p.Logs) -> p.Message:
        budget = max(0, min(msg.max_bytes, MAX_LOG_REPLY))
        chunks: dict[str, str] = {}
        offsets: dict[str, int] = {}
        log_dir = self.sd.log_dir(msg.job_id)
        files = sorted(log_dir.glob("rank*.log")) if log_dir.is_dir() else []
        for path in files:
            start = max(0, msg.offsets.get(path.name, 0))
            data = _read(path, start, budget)
            budget -= len(data)
            chunks[path.name] = data.decode(errors="replace")
            offsets[path.name] = start + len(data)
        return p.LogsReply(node_id=self.node_id, chunks=chunks, offsets=offsets)


def _read(path: Path, start: int, limit: int) -> bytes:
    """Up to `limit` bytes from `start`, cut after the last full line when the limit bites."""
    if limit <= 0:
        return b""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read(limit)
    except OSError:
        return b""
    if len(data) == limit and b"\n" in data:
        data = data[: data.rindex(b"\n") + 1]
    return data

