"""Every message of the control plane, one dataclass per message type, msgpack on the wire.

A frame is one msgpack map: ``{"v": PROTOCOL_VERSION, "op": <type>, "rid": <request id>, ...fields}``.
The version travels in every frame (so the hellos carry it too): a peer built for another version is
refused at its first message with a ``version_mismatch`` error instead of misreading fields later
(dask regrets not having this, dask#3068). ``rid`` pairs a reply with its request when a daemon relays
CLI requests to the scheduler over one shared connection.

Decoding never trusts the peer: the frame size is capped, the payload must be a msgpack map whose
fields match the dataclass annotations exactly (types checked recursively, unknown fields refused),
and nothing is ever unpickled. Any violation raises `ProtocolError`, which servers turn into a typed
`Error` reply.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, Union

import msgpack

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 1 << 20  # requests are small; logs are paged below this

# Error codes (the ``code`` of an `Error` reply).
BAD_FRAME = "bad_frame"                # not msgpack, not a map, or more than one frame
TOO_LARGE = "too_large"
VERSION_MISMATCH = "version_mismatch"
UNKNOWN_OP = "unknown_op"
BAD_REQUEST = "bad_request"            # fields missing, unknown or of the wrong type; values out of range
UNKNOWN_JOB = "unknown_job"
UNKNOWN_NODE = "unknown_node"          # a node reported before saying hello (e.g. the scheduler restarted)
INVALID_STATE = "invalid_state"        # the job's state does not allow the request
UNEXPECTED = "unexpected"              # a valid message sent to the wrong socket
SCHEDULER_UNREACHABLE = "scheduler_unreachable"
INTERNAL = "internal"

_REGISTRY: dict[str, type[Message]] = {}
_HINTS: dict[type, dict[str, Any]] = {}
M = TypeVar("M", bound="Message")


class ProtocolError(Exception):
    """A frame or request that cannot be accepted; `code` is one of the error codes above."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass(slots=True, kw_only=True)
class Message:
    op: ClassVar[str] = ""
    rid: int = 0

    def to_wire(self) -> dict[str, Any]:
        d: dict[str, Any] = {"v": PROTOCOL_VERSION, "op": self.op}
        d.update(_plain(self))
        return d

    @classmethod
    def from_wire(cls: type[M], d: dict[str, Any]) -> M:
        """Build the message from a decoded map, checking every field against its annotation.

        Raises:
            ProtocolError: `bad_request` when a field is missing, unknown or of the wrong type.
        """
        body = {k: v for k, v in d.items() if k not in ("v", "op")}
        return _build(cls, body, cls.op)

    def encode(self) -> bytes:
        return msgpack.packb(self.to_wire(), use_bin_type=True)


def message(cls: type[M]) -> type[M]:
    """Class decorator: a keyword-only slotted dataclass registered under its `op`."""
    cls = dataclass(slots=True, kw_only=True)(cls)
    if not cls.op or cls.op in _REGISTRY:
        raise TypeError(f"message {cls.__name__} needs a unique op, got {cls.op!r}")
    _REGISTRY[cls.op] = cls
    return cls


def record(cls: type[M]) -> type[M]:
    """A nested (non-message) record type, validated like a message when it appears in a field."""
    return dataclass(slots=True, kw_only=True)(cls)


def decode(frame: bytes, max_bytes: int = MAX_FRAME_BYTES) -> Message:
    """Parse one frame into its message.

    Raises:
        ProtocolError: with the code that the peer should see in the error reply.
    """
    if len(frame) > max_bytes:
        raise ProtocolError(TOO_LARGE, f"frame of {len(frame)} bytes exceeds the {max_bytes}-byte limit")
    try:
        d = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises a zoo of types on garbage
        raise ProtocolError(BAD_FRAME, f"not a msgpack frame ({type(e).__name__})") from None
    if not isinstance(d, dict):
        raise ProtocolError(BAD_FRAME, f"a frame must be a msgpack map, got {type(d).__name__}")
    v = d.get("v")
    if v != PROTOCOL_VERSION:
        raise ProtocolError(
            VERSION_MISMATCH, f"peer speaks protocol version {v!r}, this side speaks {PROTOCOL_VERSION}"
        )
    op = d.get("op")
    cls = _REGISTRY.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ProtocolError(UNKNOWN_OP, f"unknown op {op!r}")
    return cls.from_wire(d)


def peek_rid(frame: bytes) -> int:
    """Best-effort request id of a frame that failed to decode, so the error reply still pairs up."""
    try:
        d = msgpack.unpackb(frame, raw=False)
        rid = d.get("rid", 0) if isinstance(d, dict) else 0
        return rid if isinstance(rid, int) and not isinstance(rid, bool) and 0 <= rid < 2**63 else 0
    except Exception:
        return 0


def error_from(exc: ProtocolError, rid: int = 0) -> Error:
    return Error(code=exc.code, message=exc.message, rid=rid)


# --- validation -------------------------------------------------------------------------------------

_FIELD_NAMES: dict[type, tuple[str, ...]] = {}
_SCALARS = (str, int, float, bool, bytes, type(None))


def _plain(v: Any) -> Any:
    t = type(v)
    if t in _SCALARS:
        return v
    if t is list or t is tuple:
        return [_plain(x) for x in v]
    if t is dict:
        return {k: _plain(x) for k, x in v.items()}
    names = _FIELD_NAMES.get(t)
    if names is None:
        if not dataclasses.is_dataclass(v):
            return v
        names = _FIELD_NAMES[t] = tuple(f.name for f in dataclasses.fields(v))
    return {n: _plain(getattr(v, n)) for n in names}


def _hints(cls: type) -> dict[str, Any]:
    h = _HINTS.get(cls)
    if h is None:
        h = typing.get_type_hints(cls)
        _HINTS[cls] = h
    return h


# Validators are compiled once per annotation into closures: decoding is on the scheduler's hot path
# (every heartbeat of every node), and re-walking typing objects per value costs several times more.
# A checker raises `_Mismatch` without a location; `_build` adds the field path on the way out, so the
# path is only formatted when something is wrong.
_Checker = typing.Callable[[Any], Any]
_CHECKERS: dict[Any, _Checker] = {}
_PLANS: dict[type, list[tuple[str, _Checker, bool]]] = {}


class _Mismatch(Exception):
    pass


def _bad(tp: Any, v: Any) -> _Mismatch:
    return _Mismatch(f"expected {getattr(tp, '__name__', tp)}, got {type(v).__name__}")


def _plan(cls: type) -> list[tuple[str, _Checker, bool]]:
    plan = _PLANS.get(cls)
    if plan is None:
        hints = _hints(cls)
        plan = [(f.name, _checker(hints[f.name]),
                 f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                for f in dataclasses.fields(cls)]
        _PLANS[cls] = plan
    return plan


def _build(cls: type[M], body: dict[str, Any], where: str) -> M:
    try:
        return _build_unchecked(cls, body)
    except _Mismatch as e:
        raise ProtocolError(BAD_REQUEST, f"{where}{e}") from None


def _build_unchecked(cls: type[M], body: dict[str, Any]) -> M:
    kwargs: dict[str, Any] = {}
    for name, check, required in _plan(cls):
        if name in body:
            try:
                kwargs[name] = check(body[name])
            except _Mismatch as e:
                msg = str(e)
                raise _Mismatch(f".{name}{msg}" if msg.startswith(".") else f".{name}: {msg}") from None
        elif required:
            raise _Mismatch(f": missing field {name!r}")
    if len(kwargs) != len(body):
        unknown = [k for k in body if k not in kwargs]
        raise _Mismatch(f": unknown field(s) {sorted(map(str, unknown))}")
    return cls(**kwargs)


def _checker(tp: Any) -> _Checker:
    c = _CHECKERS.get(tp)
    if c is None:
        c = _compile(tp)
        _CHECKERS[tp] = c
    return c


def _exact(kind: type) -> _Checker:
    def check(v: Any) -> Any:
        if type(v) is kind:
            return v
        raise _bad(kind, v)
    return check


def _compile(tp: Any) -> _Checker:
    if tp is Any:
        return lambda v: v
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        alts = [_checker(a) for a in typing.get_args(tp)]
        nullable = type(None) in typing.get_args(tp)

        def union(v: Any) -> Any:
            if v is None and nullable:
                return None
            for alt in alts:
                try:
                    return alt(v)
                except _Mismatch:
                    continue
            raise _Mismatch(f"unexpected {type(v).__name__}")
        return union
    if tp is type(None) or tp in (bool, int, str, bytes):
        return _exact(tp)  # exact types: msgpack yields exactly these, and a bool is not an int here
    if tp is float:
        def real(v: Any) -> Any:
            if type(v) is float:
                return v
            if type(v) is int:
                return float(v)
            raise _bad(tp, v)
        return real
    if origin is list:
        item = _checker(typing.get_args(tp)[0])

        def seq(v: Any) -> Any:
            if type(v) is not list:
                raise _bad(tp, v)
            return [item(x) for x in v]
        return seq
    if origin is dict:
        kc, vc = (_checker(a) for a in typing.get_args(tp))

        def mapping(v: Any) -> Any:
            if type(v) is not dict:
                raise _bad(tp, v)
            return {kc(k): vc(x) for k, x in v.items()}
        return mapping
    if dataclasses.is_dataclass(tp):
        def nested(v: Any) -> Any:
            if type(v) is not dict:
                raise _bad(tp, v)
            return _build_unchecked(tp, v)
        return nested
    raise TypeError(f"unsupported annotation {tp!r}")


# --- replies shared by every socket -------------------------------------------------------------------

@message
class Error(Message):
    """The typed reply to anything that cannot be served; the server keeps running."""

    op: ClassVar[str] = "error"
    code: str
    message: str


@message
class Ok(Message):
    op: ClassVar[str] = "ok"
    message: str = ""


# --- CLI -> daemon -> scheduler ---------------------------------------------------------------------

@message
class Submit(Message):
    """A job: the user's script (absolute path, readable on every node) and its placement bounds."""

    op: ClassVar[str] = "submit"
    script: str
    func: str | None = None
    workers: int
    min_devices: int = 1
    max_devices: int = 0          # 0 = workers
    priority: int = 0
    name: str = ""
    cwd: str = ""
    env: dict[str, str] = field(default_factory=dict)


@message
class Submitted(Message):
    op: ClassVar[str] = "submitted"
    job_id: str


@message
class Status(Message):
    op: ClassVar[str] = "status"
    job_id: str | None = None


@record
class JobInfo:
    """One row of `elasticd status`."""

    job_id: str
    name: str
    state: str
    workers: int
    devices: int                  # M: physical agents (0 while queued)
    min_devices: int
    max_devices: int
    priority: int
    nodes: list[str]
    step: int = 0
    steps_per_s: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    script: str = ""
    submitted_at: float = 0.0
    started_at: float | None = None
    ended_at: float | None = None
    error: dict[str, Any] | None = None
    requested_devices: int | None = None
    resizes: list[dict[str, Any]] = field(default_factory=list)
    history: list[list[Any]] = field(default_factory=list)
    agents: list[dict[str, Any]] = field(default_factory=list)   # rank, node, device, pid, alive, rss, cpu


@record
class NodeInfo:
    node_id: str
    host: str
    alive: bool
    devices: list[str]
    free: list[str]
    last_seen_s: float            # seconds since the last heartbeat


@message
class StatusReply(Message):
    op: ClassVar[str] = "status_reply"
    jobs: list[JobInfo]
    nodes: list[NodeInfo]


@message
class Stop(Message):
    op: ClassVar[str] = "stop_job"
    job_id: str


@message
class Scale(Message):
    """Ask for M devices; applied at the next step boundary once live resize exists (issue 5)."""

    op: ClassVar[str] = "scale_job"
    job_id: str
    devices: int


@message
class Logs(Message):
    """Read a job's agent logs from byte `offsets` (per log file name) on.

    `node_id` "" means the daemon asked; another node's logs are fetched through the scheduler.
    """

    op: ClassVar[str] = "logs"
    job_id: str
    node_id: str = ""
    offsets: dict[str, int] = field(default_factory=dict)
    max_bytes: int = 256 * 1024


@message
class LogsReply(Message):
    op: ClassVar[str] = "logs_reply"
    node_id: str                  # the node these logs are from (agents elsewhere log there)
    chunks: dict[str, str]        # file name -> text read from its offset
    offsets: dict[str, int]       # file name -> offset to ask for next


@message
class Shutdown(Message):
    op: ClassVar[str] = "shutdown"


# --- node daemon <-> scheduler --------------------------------------------------------------------

@record
class DeviceInfo:
    device_id: str                # e.g. "cpu:0", "cuda:1" (unique within the node)
    type: str                     # "cpu" | "cuda"
    index: int
    name: str = ""


@record
class AgentReport:
    rank: int                     # physical rank p of M
    device_id: str
    pid: int
    alive: bool
    connected: bool               # the agent said hello on the control socket
    exitcode: int | None = None
    rss: int = 0                  # bytes
    cpu: float = 0.0              # percent of one core


@record
class JobReport:
    """What a node knows about one job; repeated in every heartbeat until the scheduler forgets it."""

    job_id: str
    state: str                    # "launching" | "running" | "ended"
    ranks: list[int]
    master_port: int = 0          # chosen by the node hosting rank 0
    step: int = 0
    steps_per_s: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    ok: bool = True               # for "ended": every local agent exited 0
    error: dict[str, Any] | None = None
    agents: list[AgentReport] = field(default_factory=list)
    resizes: list[dict[str, Any]] = field(default_factory=list)   # AgentResized infos of the lead agent


@message
class NodeHello(Message):
    """First message of a node (and again whenever the scheduler does not know it)."""

    op: ClassVar[str] = "node_hello"
    node_id: str
    host: str                     # address the node's agents are reachable on (rendezvous)
    devices: list[DeviceInfo]
    pid: int = 0
    jobs: list[JobReport] = field(default_factory=list)


@message
class Welcome(Message):
    op: ClassVar[str] = "welcome"
    node_id: str
    heartbeat_s: float


@message
class NodeStatus(Message):
    """The node's heartbeat: the full state of its jobs, so a lost message is repaired by the next."""

    op: ClassVar[str] = "node_status"
    node_id: str
    seq: int = 0
    jobs: list[JobReport] = field(default_factory=list)


@message
class NodeAck(Message):
    """The scheduler's heartbeat: `forget` lists finished jobs the node may drop from its reports."""

    op: ClassVar[str] = "node_ack"
    seq: int = 0
    forget: list[str] = field(default_factory=list)


@message
class NodeBye(Message):
    op: ClassVar[str] = "node_bye"
    node_id: str


@record
class RankPlacement:
    rank: int
    device_id: str


@message
class LaunchJob(Message):
    """Start this node's agents of a job. master_port 0: this node hosts rank 0 and picks the port."""

    op: ClassVar[str] = "launch_job"
    job_id: str
    script: str
    func: str | None
    workers: int
    world: int
    placements: list[RankPlacement]
    master_addr: str
    master_port: int
    cwd: str = ""
    env: dict[str, str] = field(default_factory=dict)


@message
class KillJob(Message):
    op: ClassVar[str] = "kill_job"
    job_id: str
    reason: str = ""


@message
class ResizeJob(Message):
    """Scheduler -> node: the job moves to `devices` agents, rendezvous at master_addr:master_port
    (the layout epoch `epoch`); the node passes it to its agents as `AgentResize` (live resize, issue 5)."""

    op: ClassVar[str] = "resize_job"
    job_id: str
    devices: int
    epoch: int = 0
    master_addr: str = ""
    master_port: int = 0


# --- agent <-> node daemon -------------------------------------------------------------------------

@message
class AgentHello(Message):
    op: ClassVar[str] = "agent_hello"
    job_id: str
    rank: int
    info: dict[str, Any] = field(default_factory=dict)


@message
class AgentStep(Message):
    op: ClassVar[str] = "agent_step"
    job_id: str
    rank: int
    step: int
    metrics: dict[str, Any] = field(default_factory=dict)


@message
class AgentDone(Message):
    op: ClassVar[str] = "agent_done"
    job_id: str
    rank: int
    result: dict[str, Any] = field(default_factory=dict)


@message
class AgentFailed(Message):
    op: ClassVar[str] = "agent_failed"
    job_id: str
    rank: int
    error: dict[str, Any] = field(default_factory=dict)


@message
class AgentStop(Message):
    """Daemon -> agent: stop at the next step boundary."""

    op: ClassVar[str] = "stop"


@message
class AgentResize(Message):
    """Daemon -> agent: re-form the job's group with `world` agents at master_addr:master_port
    (agent.control: {"op": "resize", "epoch", "world", "master_addr", "master_port"})."""

    op: ClassVar[str] = "resize"
    epoch: int | None = None
    world: int
    master_addr: str
    master_port: int


@message
class AgentResized(Message):
    """Agent -> daemon: a resize finished here: {"epoch", "world", "rank", "left", "seconds"}."""

    op: ClassVar[str] = "agent_resized"
    job_id: str
    rank: int
    info: dict[str, Any] = field(default_factory=dict)


def registered_ops() -> dict[str, type[Message]]:
    return dict(_REGISTRY)


def flat_scalars(d: Any, max_items: int = 64, max_str: int = 65536) -> dict[str, Any]:
    """Keep only str -> scalar entries of a peer-supplied dict (metrics, errors) before storing it.

    Such dicts are typed `Any` on the wire; flattening them bounds their size and depth so that a
    hostile or buggy agent cannot make the daemon hold or re-encode an arbitrarily nested structure.
    """
    out: dict[str, Any] = {}
    if not isinstance(d, dict):
        return out
    for k, v in d.items():
        if len(out) >= max_items:
            break
        if not isinstance(k, str):
            continue
        if isinstance(v, bool | int | float) or v is None:
            out[k[:128]] = v
        elif isinstance(v, str):
            out[k[:128]] = v[:max_str]
    return out
