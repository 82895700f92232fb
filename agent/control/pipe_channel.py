"""Control channel over two inherited pipes, for the local launcher (`elasticd run`).

The launcher and its agents share a machine and a parent process, so they talk JSON lines over pipes
the launcher created: events one way, commands the other. Nothing here listens on a socket.
"""

from __future__ import annotations

import json
import os
from typing import Any


class PipeControl:
    def __init__(self, read_fd: int, write_fd: int, physical_rank: int) -> None:
        self._r = read_fd
        self._w = write_fd
        self._rank = physical_rank
        self._buf = b""
        os.set_blocking(self._r, False)

    @classmethod
    def from_spec(cls, spec: str, physical_rank: int) -> PipeControl:
        """`pipe:R,W` -> the agent's ends of the two pipes."""
        r, w = spec.removeprefix("pipe:").split(",")
        return cls(int(r), int(w), physical_rank)

    def _send(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "rank": self._rank, **fields}, default=str) + "\n"
        try:
            os.write(self._w, line.encode())
        except BrokenPipeError:
            pass  # the launcher is gone; the agent finishes or is killed on its own

    def hello(self, info: dict[str, Any]) -> None:
        self._send("hello", **info)

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self._send("step", step=step, metrics=metrics)

    def done(self, result: dict[str, Any]) -> None:
        self._send("done", **result)

    def failed(self, error: dict[str, Any]) -> None:
        self._send("failed", **error)

    def resized(self, info: dict[str, Any]) -> None:
        self._send("resized", **info)

    def poll(self) -> list[dict[str, Any]]:
        try:
            chunk = os.read(self._r, 65536)
        except BlockingIOError:
            chunk = b""
        self._buf += chunk
        *lines, self._buf = self._buf.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
