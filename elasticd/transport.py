"""ZeroMQ sockets as the control plane uses them: CURVE on TCP, 0600 on IPC, bounded everything.

Servers are ROUTER sockets, peers are DEALER sockets. Sends never block the sender's loop: a full
queue drops the message (every message that matters is repeated by the heartbeat, see protocol.py).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator

from elasticd import keys, protocol
from elasticd.core.errors import ControlPlaneError

log = logging.getLogger(__name__)

# Larger frames are cut off by libzmq before they reach Python (the connection is dropped);
# frames between protocol.MAX_FRAME_BYTES and this get a typed `too_large` reply.
TRANSPORT_MAX_BYTES = 4 * protocol.MAX_FRAME_BYTES
SEND_HWM = 10_000
# A CURVE peer must finish its handshake within this (libzmq's default is 30 s): an idle connection that
# never presents a key holds a file descriptor only this long, so reconnecting is all an attacker can do.
HANDSHAKE_IVL_MS = 3000
IPC_PATH_MAX = 100  # sun_path is 108 bytes on Linux; leave room for the NUL


class TransportError(ControlPlaneError, RuntimeError):
    """A socket could not be set up (bad endpoint, path too long, port taken)."""


def raise_fd_limit(want: int = 65536) -> int:
    """Raise the soft limit on open files toward the hard one; returns the new soft limit.

    Every TCP connection holds a descriptor until its handshake succeeds or times out; at a soft limit of
    1024, a few hundred idle connections left libzmq unable to accept (and spinning on the listener).
    """
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return target
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft


def is_tcp(endpoint: str) -> bool:
    return endpoint.startswith("tcp://")


def ipc_endpoint(path: Path) -> str:
    """The ipc:// endpoint of a socket file.

    Raises:
        TransportError: if the path exceeds what a Unix socket address can hold.
    """
    s = str(Path(path).absolute())
    if len(s.encode()) > IPC_PATH_MAX:
        raise TransportError(f"socket path too long for a Unix socket ({len(s)} bytes): {s}; "
                             "use a shorter --state-dir")
    return "ipc://" + s


def _common(sock: zmq.Socket) -> None:
    sock.linger = 0
    sock.maxmsgsize = TRANSPORT_MAX_BYTES
    sock.sndhwm = SEND_HWM
    sock.rcvhwm = SEND_HWM


def router(ctx: zmq.Context) -> zmq.Socket:
    sock = ctx.socket(zmq.ROUTER)
    _common(sock)
    return sock


def dealer(ctx: zmq.Context, *, immediate: bool = True) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    _common(sock)
    # Without IMMEDIATE a DEALER queues messages for a peer that is not connected yet and floods it
    # with stale heartbeats when it comes back.
    sock.immediate = 1 if immediate else 0
    return sock


def bind_ipc(sock: zmq.Socket, path: Path, shared: bool = False) -> str:
    """Bind a Unix socket readable and writable by the owner only.

    The directory is made 0700 first so there is no window in which another user could connect
    between bind() and chmod(). `shared`: a socket any local user may connect to (mode 0666) in a
    directory its caller prepared; what it serves must then check who speaks (the agent socket's tokens).
    """
    path = Path(path)
    if not shared:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
    ep = ipc_endpoint(path)
    try:
        sock.bind(ep)
    except zmq.ZMQError as e:
        raise TransportError(f"cannot bind {ep}: {e}") from e
    os.chmod(path, 0o666 if shared else stat.S_IRUSR | stat.S_IWUSR)
    return ep


def bind_tcp(sock: zmq.Socket, endpoint: str) -> str:
    """Bind a TCP endpoint (port 0 or * picks a free port) and return the actual endpoint.

    Raises:
        TransportError: if the address cannot be bound.
    """
    ep = endpoint
    if ep.endswith(":0"):
        ep = ep[:-2] + ":*"
    try:
        sock.bind(ep)
    except zmq.ZMQError as e:
        raise TransportError(f"cannot bind {endpoint}: {e}") from e
    return sock.last_endpoint.decode()


def curve_server(sock: zmq.Socket, identity: tuple[bytes, bytes]) -> None:
    public, secret = identity
    sock.handshake_ivl = HANDSHAKE_IVL_MS
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True


def curve_client(sock: zmq.Socket, identity: tuple[bytes, bytes], server_public: bytes) -> None:
    public, secret = identity
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_serverkey = server_public


class AllowList:
    """The ZAP check of a CURVE server: is this client's public key on the state dir's allow-list, and
    with which grant (keys.KeyGrant: role, node id)?

    The list is re-read when the directory changes, so `elasticd keygen --allow` takes effect on a
    running daemon without a restart. Refusals are logged once per key and then as one summary line per
    `log_every_s`: anyone who can reach the port can cause them, so they must not grow the log at the
    rate an attacker reconnects.
    """

    def __init__(self, state_dir: Path, *, log_every_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 ) -> None:
        self._state_dir = Path(state_dir)
        self._lock = threading.Lock()
        self._mtime: int | None = None
        self._grants: dict[bytes, keys.KeyGrant] = {}
        self._log_every_s = log_every_s
        self._clock = clock
        self._logged: set[bytes] = set()      # keys whose first refusal was logged (bounded below)
        self._quiet = 0                       # refusals since the last summary line
        self._quiet_keys: set[bytes] = set()
        self._next_summary = 0.0
        self.denied = 0

    def _reload(self) -> None:
        try:
            mtime = keys.allowed_dir(self._state_dir).stat().st_mtime_ns
        except FileNotFoundError:
            mtime = None
        if mtime != self._mtime:
            self._grants = keys.allowed_grants(self._state_dir)
            self._mtime = mtime

    def grant(self, z85_key: bytes | str) -> keys.KeyGrant | None:
        """The grant of an authenticated peer (its ZMQ User-Id is its Z85 key); None once removed."""
        k = z85_key.encode() if isinstance(z85_key, str) else z85_key
        with self._lock:
            self._reload()
            return self._grants.get(k)

    def callback(self, domain: str, client_key: bytes) -> bool:
        key = client_key if len(client_key) == 40 else (
            zmq.utils.z85.encode(client_key) if len(client_key) == 32 else client_key)
        with self._lock:
            self._reload()
            ok = key in self._grants
            if not ok:
                self.denied += 1
                self._note_refusal(key)
            return ok

    def _note_refusal(self, key: bytes) -> None:
        now = self._clock()
        if key not in self._logged and len(self._logged) < 1024:
            self._logged.add(key)
            log.warning("refused CURVE client %s: key not on the allow-list of %s (further refusals are "
                        "summarised every %.0fs)", _printable(key), self._state_dir, self._log_every_s)
            return
        self._quiet += 1
        if len(self._quiet_keys) < 1024:
            self._quiet_keys.add(key)
        if now >= self._next_summary:
            log.warning("refused %d more CURVE connection(s) from %s%d key(s) not on the allow-list",
                        self._quiet, "at least " if len(self._quiet_keys) >= 1024 else "", len(self._quiet_keys))
            self._quiet, self._quiet_keys = 0, set()
            self._next_summary = now + self._log_every_s


def _printable(key: bytes) -> str:
    try:
        return (zmq.utils.z85.encode(key) if len(key) == 32 else key).decode()
    except Exception:
        return repr(key)


class _Callback:
    def __init__(self, fn: Callable[[str, bytes], bool]) -> None:
        self._fn = fn

    def callback(self, domain: str, key: bytes) -> bool:
        return self._fn(domain, key)


def start_authenticator(ctx: zmq.Context, allow: AllowList) -> ThreadAuthenticator:
    """Start ZAP for `ctx`: every CURVE server socket in the context checks the allow-list."""
    zap_log = logging.getLogger("elasticd.auth")
    # pyzmq logs every ZAP decision at DEBUG: one line per connection attempt of anyone who can reach the
    # port, even at --log-level DEBUG. AllowList logs refusals, rate-limited, instead.
    zap_log.setLevel(logging.INFO)
    auth = ThreadAuthenticator(ctx, log=zap_log)
    auth.start()
    auth.configure_curve_callback(domain="*", credentials_provider=_Callback(allow.callback))
    return auth


def recv_request(sock: zmq.Socket) -> tuple[bytes, bytes, int, str | None] | None:
    """One message from a ROUTER socket without blocking: (peer identity, first payload frame, number of
    extra frames, the peer's ZAP User-Id), or None when nothing is waiting.

    Extra frames (the protocol has one payload frame) are counted and released one by one, never joined
    or copied into Python objects. The User-Id is the Z85 key CURVE authenticated (None on IPC/inproc).
    """
    try:
        ident = sock.recv(zmq.NOBLOCK)
    except zmq.Again:
        return None
    if not sock.rcvmore:
        return ident, b"", -1, None
    frame = sock.recv(copy=False)
    try:
        user_id = frame.get("User-Id") if sock.curve_server else None
    except zmq.ZMQError:
        user_id = None
    extra = 0
    while frame.more:
        frame = sock.recv(copy=False)
        extra += 1
    return ident, frame.bytes if extra == 0 else b"", extra, user_id


def send(sock: zmq.Socket, msg: protocol.Message, identity: bytes | None = None) -> bool:
    """Send without blocking; False when the message was dropped (peer gone or queue full)."""
    frames = [msg.encode()] if identity is None else [identity, msg.encode()]
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
        return True
    except zmq.Again:
        return False
    except zmq.ZMQError as e:
        log.debug("send of %s dropped: %s", msg.op, e)
        return False
