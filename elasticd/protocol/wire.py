"""The wire format of the control plane: envelope, validation, errors, and the shared replies.

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
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar, Union

import msgpack

from elasticd.core.errors import ControlPlaneError
from elasticd.core.records import wire_name
from elasticd.protocol.limits import MAX_METRIC_CHARS, MAX_METRICS

PROTOCOL_VERSION = 10  # 10: live moves of jobs spanning islands (MovePortion, GoPortion, AbortPortionMove, islands in resizes)
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
FORBIDDEN = "forbidden"                # the peer's key (role, node id, ownership) does not allow the request
QUOTA = "quota"                        # a per-owner or island-wide limit on jobs is reached
INTERNAL = "internal"
BUSY = "busy"                          # this peer has too many requests in flight or sends too fast: retry later

# A value of a flat record (a user's `ctx.log` metric, a field of an error report): what a peer may send in
# a map of scalars, bounded in count and length where it is made (`flat_scalars`).
Scalar = bool | int | float | str | None

_REGISTRY: dict[str, type[Message]] = {}
_HINTS: dict[type, dict[str, Any]] = {}
M = TypeVar("M", bound="Message")


class ProtocolError(ControlPlaneError):
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
        msg = _build(cls, body, cls.op)
        why = msg.check()
        if why is not None:
            raise ProtocolError(BAD_REQUEST, f"{cls.op}: {why}")
        return msg

    def check(self) -> str | None:
        """Why the values (not the types, which decoding checks) are unacceptable; None when they are
        fine. Messages with bounded fields override this (elasticd.protocol.limits)."""
        return None

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
    return from_dict(d)


def from_dict(d: dict[str, Any]) -> Message:
    """The message a decoded map holds, whatever carried it (a msgpack frame, or a JSON line on the
    pipes of `elasticd run`): the version, the op and every field are checked the same way.

    Raises:
        ProtocolError: `version_mismatch`, `unknown_op` or `bad_request`.
    """
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


def peek_op(frame: bytes) -> str | None:
    """The op of a frame without unpacking the rest (`Message.encode` writes "v" and "op" first), so that a
    server can serve a node's heartbeat before the client requests queued ahead of it. None: not a frame
    of ours."""
    try:
        u = msgpack.Unpacker(raw=False, max_buffer_size=max(len(frame), 1))
        u.feed(frame)
        for _ in range(min(u.read_map_header(), 2)):
            key, value = u.unpack(), u.unpack()
            if key == "op":
                return value if isinstance(value, str) else None
    except Exception:
        return None
    return None


def error_from(exc: ProtocolError, rid: int = 0) -> Error:
    return Error(code=exc.code, message=exc.message, rid=rid)


# --- validation -------------------------------------------------------------------------------------

_FIELD_NAMES: dict[type, tuple[tuple[str, str], ...]] = {}
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
        names = _FIELD_NAMES[t] = tuple((f.name, wire_name(f)) for f in dataclasses.fields(v))
    return {key: _plain(getattr(v, attr)) for attr, key in names}


def plain(record: Any) -> Any:
    """`record` (a message, a nested record, or lists and maps of them) as the plain map the wire carries:
    what `--json` prints, with each field under its wire name."""
    return _plain(record)




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
_PLANS: dict[type, list[tuple[str, str, _Checker, bool]]] = {}


class _Mismatch(ControlPlaneError):
    """A field of the wrong type, found while decoding; reported as the `ProtocolError` that names the field."""


def _bad(tp: Any, v: Any) -> _Mismatch:
    return _Mismatch(f"expected {getattr(tp, '__name__', tp)}, got {type(v).__name__}")


def _plan(cls: type) -> list[tuple[str, str, _Checker, bool]]:
    plan = _PLANS.get(cls)
    if plan is None:
        hints = _hints(cls)
        plan = [(f.name, wire_name(f), _checker(hints[f.name]),
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
    for attr, key, check, required in _plan(cls):
        if key in body:
            try:
                kwargs[attr] = check(body[key])
            except _Mismatch as e:
                msg = str(e)
                raise _Mismatch(f".{key}{msg}" if msg.startswith((".", ":")) else f".{key}: {msg}") from None
        elif required:
            raise _Mismatch(f": missing field {key!r}")
    if len(kwargs) != len(body):
        keys = {key for _, key, _, _ in _plan(cls)}
        unknown = [k for k in body if k not in keys]
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
    if origin is tuple:   # a fixed-length row, a list on the wire: (at, state, reason)
        args = typing.get_args(tp)
        if not args or args[-1] is Ellipsis:
            raise TypeError(f"unsupported annotation {tp!r}: only fixed-length tuples")
        items = [_checker(a) for a in args]

        def row(v: Any) -> Any:
            if type(v) is not list or len(v) != len(items):
                raise _Mismatch(f"expected a list of {len(items)}, got {type(v).__name__}"
                                + (f" of {len(v)}" if type(v) is list else ""))
            return tuple(c(x) for c, x in zip(items, v, strict=True))
        return row
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


def encoded_size(record: Any) -> int:
    """Bytes `record` (a message or nested record) takes on the wire, for paging replies under the limit."""
    return len(msgpack.packb(_plain(record), use_bin_type=True))


def registered_ops() -> dict[str, type[Message]]:
    return dict(_REGISTRY)


# The longest text a peer-supplied record keeps (a failure's message or traceback, a metric's string).
MAX_TEXT_CHARS = 65536


def flat_metrics(d: Any) -> dict[str, Any]:
    """`flat_scalars` at the bounds of a job's `ctx.log` values (protocol/limits.py)."""
    return flat_scalars(d, max_items=MAX_METRICS, max_str=MAX_METRIC_CHARS)


def flat_scalars(d: Any, max_items: int = 64, max_str: int = MAX_TEXT_CHARS) -> dict[str, Any]:
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
