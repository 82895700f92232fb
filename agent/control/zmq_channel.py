"""The agent's control channel to its node daemon, over ZeroMQ (IPC socket in the daemon's state dir).

Never blocks the training loop: sends are fire-and-forget (NOBLOCK into a bounded queue; a full
queue drops the message and counts it), step reports are coalesced to at most one every
`step_every_s` (the last one is flushed before `done`/`failed`), and `poll` only reads what has
already arrived. The runtime may call it from any of its worker threads, one at a time; a lock makes
that safe for the (single-threaded) ZeroMQ socket.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time

import zmq

from elasticd import protocol as p
from elasticd.core.env_names import AGENT_TOKEN_VAR
from elasticd.core.timing import merge_timing

log = logging.getLogger(__name__)

SEND_HWM = 1000
CLOSE_LINGER_MS = 2000   # long enough to deliver done/failed to a live daemon, bounded if it is gone


class ZmqControl:
    def __init__(self, endpoint: str, job_id: str, physical_rank: int, step_every_s: float = 0.1) -> None:
        self.job_id = job_id
        # Taken out of the environment: the job's own child processes have no business with it.
        self._token = os.environ.pop(AGENT_TOKEN_VAR, "")
        self.rank = physical_rank
        self.step_every_s = step_every_s
        self.dropped = 0
        self._said: tuple[int, str] | None = None   # the refusal last told the job's log: (step, message)
        self._lock = threading.Lock()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.sndhwm = SEND_HWM
        self._sock.rcvhwm = SEND_HWM
        self._sock.maxmsgsize = 4 * p.MAX_FRAME_BYTES
        self._sock.linger = CLOSE_LINGER_MS
        self._sock.connect(endpoint)
        self._last_step_sent = -math.inf   # the first report goes at once, however young the clock
        self._pending_step: p.AgentStep | None = None
        self._closed = False

    def _send(self, msg: p.Message) -> None:
        if self._closed:
            return
        try:
            self._sock.send(msg.encode(), zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
        except zmq.ZMQError as e:
            self.dropped += 1
            log.debug("control send failed: %s", e)

    def hello(self, info: p.AgentInfo) -> None:
        with self._lock:
            self._send(p.AgentHello(job_id=self.job_id, rank=self.rank, info=info, token=self._token))

    def step(self, step: int, metrics: dict[str, p.Scalar], timing: dict[str, int | float] | None = None,
             held: bool = False) -> None:
        msg = p.AgentStep(job_id=self.job_id, rank=self.rank, step=int(step), metrics=p.flat_metrics(metrics),
                          timing=dict(timing or {}))
        now = time.monotonic()
        with self._lock:
            if self._pending_step is not None:
                # A throttled report is replaced, not lost: its steps' timing goes on in this one's means.
                msg.timing = merge_timing(self._pending_step.timing, msg.timing)
            if held or now - self._last_step_sent >= self.step_every_s:
                self._last_step_sent = now
                self._pending_step = None
                self._send(msg)
            else:
                self._pending_step = msg

    def _flush_step(self) -> None:
        if self._pending_step is not None:
            self._send(self._pending_step)
            self._pending_step = None

    def done(self, stopped: bool) -> None:
        with self._lock:
            self._flush_step()
            self._send(p.AgentDone(job_id=self.job_id, rank=self.rank, stopped=stopped))

    def failed(self, error: p.AgentError) -> None:
        with self._lock:
            self._flush_step()
            self._send(p.AgentFailed(job_id=self.job_id, rank=self.rank, error=error))

    def resized(self, info: p.ResizedInfo) -> None:
        with self._lock:
            self._flush_step()
            self._send(p.AgentResized(job_id=self.job_id, rank=self.rank, info=info))
            # The first step at the new size is what ends a resize for the daemon: report it unthrottled.
            self._last_step_sent = -math.inf   # the first report goes at once, however young the clock

    def refused(self, info: p.RefusedInfo) -> None:
        # Into the job's log, where its user looks (`elasticd logs`; `status` has it too), once: a refusal
        # made before this agent's copy of the command came is sent again with its epoch when the copy does.
        if self.rank == 0 and self._said != (info.step, info.message):
            self._said = (info.step, info.message)
            print(f"[elasticd] resize after step {info.step} refused, training goes on: {info.message}",
                  file=sys.stderr, flush=True)
        with self._lock:
            self._flush_step()
            self._send(p.AgentResizeRefused(job_id=self.job_id, rank=self.rank, info=info))

    def poll(self) -> list[p.AgentCommand]:
        """Commands from the node: `AgentStop`, `AgentResize` or `AgentJoin`. A frame that is no command is
        logged and dropped: a daemon is another process that may be of another build, and the agent must
        keep training."""
        out: list[p.AgentCommand] = []
        with self._lock:
            if self._closed:
                return out
            self._flush_step_if_due()
            while True:
                try:
                    frame = self._sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                except zmq.ZMQError:
                    break
                try:
                    msg = p.decode(frame)
                except p.ProtocolError as e:
                    log.warning("unreadable message from the daemon: %s", e)
                    continue
                if isinstance(msg, p.Error):
                    log.warning("daemon refused a control message: %s: %s", msg.code, msg.message)
                    continue
                if not isinstance(msg, p.COMMANDS):
                    log.warning("the daemon sent %r, which is no agent command", msg.op)
                    continue
                out.append(msg)  # type: ignore[arg-type]  # one of COMMANDS
        return out

    def _flush_step_if_due(self) -> None:
        if self._pending_step is not None and time.monotonic() - self._last_step_sent >= self.step_every_s:
            self._last_step_sent = time.monotonic()
            self._flush_step()

    def renumber(self, physical_rank: int) -> None:
        self.rank = physical_rank

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._flush_step()
            self._closed = True
            self._sock.close()
            self._ctx.term()
