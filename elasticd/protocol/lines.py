"""One message per JSON line: the framing of the pipes between `elasticd run` and its agents.

What travels is the typed messages of `elasticd.protocol.agents`, the same the node daemon exchanges with
its agents over ZeroMQ, one `Message.to_wire()` map per line: a line is readable in a debugger, and both
ends decode it with the protocol's own validation (`from_dict`). Decoding is strict: a line that is not a
known message of the expected direction raises `ProtocolError` instead of being skipped, since launcher
and agent are one install.
"""

from __future__ import annotations

import json

from elasticd import protocol as p


def encode_line(msg: p.Message) -> bytes:
    """One message as one JSON line."""
    return (json.dumps(msg.to_wire()) + "\n").encode()


def decode_line(line: bytes, expected: tuple[type[p.Message], ...]) -> p.Message:
    """The message of one JSON line, which must be one of `expected`.

    Raises:
        ProtocolError: not JSON, not a map, an unknown op, a bad field, or a message of the other direction.
    """
    try:
        d = json.loads(line)
    except ValueError as e:
        raise p.ProtocolError(p.BAD_FRAME, f"not a JSON line ({e})") from None
    if not isinstance(d, dict):
        raise p.ProtocolError(p.BAD_FRAME, f"a line must hold a JSON object, got {type(d).__name__}")
    msg = p.from_dict(d)
    if not isinstance(msg, expected):
        raise p.ProtocolError(p.UNEXPECTED, f"{msg.op!r} does not belong on this side of an agent's pipe")
    return msg


class LineReader:
    """Splits what a pipe delivered into messages; keeps an incomplete last line for the next read."""

    def __init__(self, expected: tuple[type[p.Message], ...]) -> None:
        self._expected = expected
        self._buf = b""

    def feed(self, chunk: bytes) -> list[p.Message]:
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        return [decode_line(line, self._expected) for line in lines if line.strip()]
