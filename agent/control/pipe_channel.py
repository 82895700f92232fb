"""Control channel over two inherited pipes, for the local launcher (`elasticd run`).

The launcher and its agents share a machine and a parent process, so they talk over pipes the launcher
created (events one way, commands the other) and nothing listens on a socket. What travels is the
typed messages of `elasticd.protocol.agents`, the same the node daemon exchanges with its agents over
ZeroMQ, one `Message.to_wire()` map per JSON line: a line is readable in a debugger, and both ends
decode it with the protocol's own validation (`from_dict`), so the agent handles one set of command
objects whoever launched it. Decoding is strict: a line that is not a known message of the expected
direction raises `ProtocolError` instead of being skipped, since launcher and agent are one install.
"""

from __future__ import annotations

import os

from elasticd import protocol as p
from elasticd.protocol.lines import LineReader, encode_line


class PipeControl:
    def __init__(self, read_fd: int, write_fd: int, job_id: str, physical_rank: int) -> None:
        self._r = read_fd
        self._w = write_fd
        self.job_id = job_id
        self.rank = physical_rank
        self._commands = LineReader(p.COMMANDS)
        os.set_blocking(self._r, False)

    @classmethod
    def from_spec(cls, spec: str, job_id: str, physical_rank: int) -> PipeControl:
        """`pipe:R,W` -> the agent's ends of the two pipes."""
        r, w = spec.removeprefix("pipe:").split(",")
        return cls(int(r), int(w), job_id, physical_rank)

    def _send(self, msg: p.Message) -> None:
        try:
            os.write(self._w, encode_line(msg))
        except BrokenPipeError:
            pass  # the launcher is gone; the agent finishes or is killed on its own

    # The user's metrics are bounded as on the ZeroMQ channel, so a launcher sees the same objects.
    def hello(self, info: p.AgentInfo) -> None:
        self._send(p.AgentHello(job_id=self.job_id, rank=self.rank, info=info))

    def step(self, step: int, metrics: dict[str, p.Scalar], timing: dict[str, int | float] | None = None,
             held: bool = False) -> None:
        self._send(p.AgentStep(job_id=self.job_id, rank=self.rank, step=int(step), metrics=p.flat_metrics(metrics),
                               timing=dict(timing or {})))

    def done(self, stopped: bool) -> None:
        self._send(p.AgentDone(job_id=self.job_id, rank=self.rank, stopped=stopped))

    def failed(self, error: p.AgentError) -> None:
        self._send(p.AgentFailed(job_id=self.job_id, rank=self.rank, error=error))

    def resized(self, info: p.ResizedInfo) -> None:
        self._send(p.AgentResized(job_id=self.job_id, rank=self.rank, info=info))

    def refused(self, info: p.RefusedInfo) -> None:
        self._send(p.AgentResizeRefused(job_id=self.job_id, rank=self.rank, info=info))

    def poll(self) -> list[p.AgentCommand]:
        """Commands that arrived, never blocking.

        Raises:
            ProtocolError: the launcher wrote something that is not a command.
        """
        try:
            chunk = os.read(self._r, 65536)
        except BlockingIOError:
            chunk = b""
        return self._commands.feed(chunk)  # type: ignore[return-value]  # checked against COMMANDS

    def renumber(self, physical_rank: int) -> None:
        self.rank = physical_rank

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass
