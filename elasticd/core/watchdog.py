"""Telling a stuck agent from a slow one: the agent's beat file and the supervisor's verdict.

Each agent keeps a small beat file beside its error report (`beat_path`): whether it is inside a
physical collective and since when, and the last step it completed and when (CLOCK_MONOTONIC, which
every process of one machine shares). Its supervisor, `elasticd run` or the node daemon, reads it
with the process's state and asks `Watchdog.verdict` which agents to fence (SIGKILL); the job then
recovers as it does from a killed agent.

An agent is stuck, not slow, when the job is waiting on it and nothing it does will end the wait:

- its process is stopped (SIGSTOP, a tracer's stop) for longer than the bound; or
- other agents of the job have waited inside one collective for longer than the bound while it has not
  joined them (a wedged kernel, a deadlock, a process swapped to death): it is fenced, they are not; or
- every agent has been inside a collective for longer than the bound (a collective that never returns,
  or agents that entered different ones): all of them are fenced.

An agent computing for a long time while no one waits for it (every agent evaluating, a first step that
compiles) is slow. The bound adapts to the job: `FIRST_BOUND_S` until `WARM_STEPS` steps have completed
(compilation, first data loads), then the larger of `FLOOR_S` and `FACTOR` times the slowest step seen
lately, so an evaluation every so many steps stretches it. `--stuck-after SECONDS` fixes it, `off`
turns the watchdog off.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
import threading
import time
from collections.abc import Hashable, Iterable
from dataclasses import dataclass, field

import psutil

from elasticd.core.files import read_regular

FIRST_BOUND_S = 900.0   # until WARM_STEPS steps completed: compilation, cold caches, first loads
FLOOR_S = 300.0         # never less, afterwards: an evaluation a few hundred steps apart
FACTOR = 20.0           # times the slowest step lately
WARM_STEPS = 3
_RECENT = 32            # step intervals remembered per agent
WATCH_EVERY_S = 0.5     # how often a supervisor reads its agents' beats

_FORMAT = struct.Struct("<qdqd")   # in_collective, since (monotonic), last step completed, completed at
IDLE, IN_COLLECTIVE = 0, 1


def is_stopped(status: str) -> bool:
    """Whether a process state (psutil's `status()`) is a stop: SIGSTOP or a tracer's."""
    return status in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


def beat_path(error_file: str) -> str:
    """The beat file of the agent whose error report goes to `error_file`."""
    return error_file + ".beat"


@dataclass(frozen=True, slots=True)
class StuckAfter:
    """The bound: adaptive (`seconds` None), fixed, or off."""

    seconds: float | None = None
    off: bool = False

    @classmethod
    def parse(cls, text: str) -> StuckAfter:
        """"auto", "off", or seconds ("90", "90s").

        Raises:
            ValueError: anything else.
        """
        t = text.strip().lower()
        if t == "auto":
            return cls()
        if t in ("off", "0"):
            return cls(off=True)
        try:
            value = float(t[:-1] if t.endswith("s") else t)
        except ValueError:
            value = -1.0
        if not (0 < value < float("inf")):
            raise ValueError(f"--stuck-after {text!r}: give seconds (90, 90s), auto or off")
        return cls(seconds=value)

    def __str__(self) -> str:
        return "off" if self.off else "auto" if self.seconds is None else f"{self.seconds:g}s"


@dataclass(frozen=True, slots=True)
class Beat:
    in_collective: bool
    since: float          # monotonic time it entered or left its latest collective
    step: int             # last step completed; -1: none yet
    step_at: float        # when (monotonic); 0.0: none yet

    def on_clock(self, now: float, monotonic_now: float) -> Beat:
        """The same beat on the clock of a supervisor whose `now` is another clock's (the daemon's wall clock)."""
        shift = now - monotonic_now
        return Beat(self.in_collective, self.since + shift, self.step, self.step_at + shift if self.step_at else 0.0)


class BeatWriter:
    """The agent's side: a shared mapping of its beat file, written at every physical collective and step."""

    def __init__(self, path: str) -> None:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, _FORMAT.size)
            self._map = mmap.mmap(fd, _FORMAT.size)
        finally:
            os.close(fd)
        self._lock = threading.Lock()   # worker threads and the snapshot writer's thread
        self._depth = 0
        self._since = time.monotonic()
        self._step, self._step_at = -1, 0.0
        self._write()

    def _write(self) -> None:
        _FORMAT.pack_into(self._map, 0, IN_COLLECTIVE if self._depth else IDLE, self._since, self._step,
                          self._step_at)

    def entered(self) -> None:
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                self._since = time.monotonic()
                self._write()

    def left(self) -> None:
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                self._since = time.monotonic()
                self._write()

    def stepped(self, step: int) -> None:
        with self._lock:
            self._step, self._step_at = step, time.monotonic()
            self._write()

    def close(self) -> None:
        self._map.close()


def read_beat(path: str) -> Beat | None:
    """An agent's beat, or None before it wrote one (or when the file is unreadable). The agent owns the
    directory: a link or a FIFO in the beat file's place is not followed or waited on."""
    data = read_regular(path, _FORMAT.size)
    if data is None or len(data) < _FORMAT.size:
        return None
    state, since, step, step_at = _FORMAT.unpack(data)
    return Beat(state == IN_COLLECTIVE, since, step, step_at)


@dataclass(frozen=True, slots=True)
class Fence:
    key: Hashable   # the agent, as the caller named it to `observe`
    reason: str     # "stopped for 31s", in words, for the error report and `events`
    held: float     # seconds the job has been held by it: the detection's delay

    def cause(self, rank: int, bound: str) -> str:
        """The failure's cause in words, as `elasticd run` and the daemon both record it (the job's error,
        its recovery, `events`); `bound`: the watchdog's `describe()` when it fenced."""
        return f"agent {rank} was stuck ({self.reason}, --stuck-after {bound}) and was fenced"


_FENCED = re.compile(r"agent (\d+) was stuck \((.*), --stuck-after ([^)]*)\) and was fenced")


def fence_said(text: str) -> str | None:
    """What `elasticd run` says as it fences, read off a failure's cause (`Fence.cause`) in `text`."""
    m = _FENCED.search(text)
    return f"agent {m[1]} is stuck ({m[2]}, --stuck-after {m[3]}); fencing it (SIGKILL)" if m else None


@dataclass
class _Seen:
    stopped_since: float | None = None
    beat: Beat | None = None
    intervals: list[float] = field(default_factory=list)   # seconds per step, latest last
    steps: int = 0                                           # steps seen completed


class Watchdog:
    """One job's agents on one supervisor, named by any key (a pid: a new agent starts afresh); pure: `now`
    and what was read of the agents come in."""

    def __init__(self, after: StuckAfter) -> None:
        self.after = after
        self._seen: dict[Hashable, _Seen] = {}

    def retain(self, keys: Iterable[Hashable]) -> None:
        """The job's agents are now these: what was seen of others (exited, left, fenced) says nothing."""
        keep = set(keys)
        for k in [k for k in self._seen if k not in keep]:
            del self._seen[k]

    def describe(self) -> str:
        """The bound in words: "3s", "off", "auto: 900s now"."""
        return str(self.after) if self.after.seconds is not None or self.after.off else f"auto: {self.bound():.0f}s now"

    def observe(self, key: Hashable, now: float, stopped: bool, beat: Beat | None) -> None:
        seen = self._seen.setdefault(key, _Seen())
        if not stopped:
            seen.stopped_since = None
        elif seen.stopped_since is None:
            seen.stopped_since = now
        old = seen.beat
        if beat is not None and old is not None and beat.step > old.step >= 0 and beat.step_at > old.step_at:
            seen.intervals.append((beat.step_at - old.step_at) / (beat.step - old.step))
            del seen.intervals[:-_RECENT]
        if beat is not None and beat.step >= 0:
            seen.steps = max(seen.steps, beat.step + 1)
        seen.beat = beat

    def bound(self) -> float:
        if self.after.seconds is not None:
            return self.after.seconds
        if not self._seen or min(s.steps for s in self._seen.values()) < WARM_STEPS:
            return FIRST_BOUND_S
        slowest = max((i for s in self._seen.values() for i in s.intervals), default=0.0)
        return max(FLOOR_S, FACTOR * slowest)

    def verdict(self, now: float) -> list[Fence]:
        """The agents to fence now (none twice: the caller forgets a job's agents once it fenced them)."""
        if self.after.off or not self._seen:
            return []
        bound = self.bound()
        stopped = [Fence(k, f"stopped for {now - s.stopped_since:.0f}s", now - s.stopped_since)
                   for k, s in self._seen.items() if s.stopped_since is not None and now - s.stopped_since > bound]
        if stopped:
            return stopped
        waiting = {k: now - s.beat.since for k, s in self._seen.items()
                   if s.beat is not None and s.beat.in_collective and now - s.beat.since > bound}
        if not waiting:
            return []
        # A stopped process is the one the others wait for, whatever its beat says (it may have been stopped
        # inside the collective they wait in): it alone is fenced, though it has not been stopped as long.
        halted = [k for k, s in self._seen.items() if s.stopped_since is not None]
        if halted:
            others = {k: w for k, w in waiting.items() if k not in halted} or waiting
            held = max(others.values())
            return [Fence(k, f"stopped, and {len(others)} other agent(s) waited {held:.0f}s in a collective for it",
                          held) for k in halted]
        if len(waiting) == len(self._seen):
            longest = max(waiting.values())
            return [Fence(k, f"inside one collective for {w:.0f}s, as every other agent (longest {longest:.0f}s)",
                          longest) for k, w in waiting.items()]
        laggards = [k for k, s in self._seen.items()
                    if k not in waiting and not (s.beat is not None and s.beat.in_collective)]
        held = max(waiting.values())
        return [Fence(k, f"{len(waiting)} other agent(s) waited {held:.0f}s in a collective it did not join", held)
                for k in laggards]
