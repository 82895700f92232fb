"""This agent's beat file (elasticd/core/watchdog.py): inside a physical collective or not, since when, and
the last step completed, for its supervisor's watchdog to tell a stuck agent from a slow one.

Process-wide, as the physical group is: set up once the agent knows its error report's path; until then
(and in a process no supervisor watches: a standalone run, a test's in-process runtime) nothing is
written."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from elasticd.core.watchdog import BeatWriter, beat_path

_writer: BeatWriter | None = None


def start(error_file: str) -> None:
    global _writer
    if error_file and _writer is None:
        _writer = BeatWriter(beat_path(error_file))


@contextlib.contextmanager
def waiting() -> Iterator[None]:
    """Around a blocking physical collective: the time the other agents may keep this one waiting."""
    w = _writer
    if w is None:
        yield
        return
    w.entered()
    try:
        yield
    finally:
        w.left()


def stepped(step: int) -> None:
    if _writer is not None:
        _writer.stepped(step)
