"""The daemon's and scheduler's own log file: size-bounded, owner-only, never through a symlink.

Anyone who can reach the TCP port can make the daemon log (a refused key, a bad frame), so the file
rotates (`RotatingFileHandler`: at most `backups` + 1 files of `max_bytes`). It is opened with
O_NOFOLLOW: a `daemon.log` symlink planted in a state dir must not make the daemon append to a file of
someone else's choosing. Its records are one line each (`OneLineFormatter`).
"""

from __future__ import annotations

import logging.handlers
import os

from elasticd.core.text import printable

MAX_BYTES = 16 * 2**20
BACKUPS = 3


class SafeRotatingFileHandler(logging.handlers.RotatingFileHandler):
    def __init__(self, filename: str, max_bytes: int = MAX_BYTES, backups: int = BACKUPS) -> None:
        super().__init__(filename, maxBytes=max_bytes, backupCount=backups, encoding="utf-8", delay=False)

    def _open(self):  # noqa: ANN202 - the base class's signature
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600)
        return os.fdopen(fd, "a", encoding=self.encoding, errors=self.errors)


class OneLineFormatter(logging.Formatter):
    """Each record's message on one line, control characters escaped: messages carry job-supplied text (an
    error's message and traceback, a job's name), which must not forge log lines or send escape sequences
    to whoever reads the log. A traceback of the daemon's own (`exc_info`) follows as usual."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 - logging's name
        record.message = printable(record.message)
        return super().formatMessage(record)


def open_log(path: os.PathLike[str] | str) -> SafeRotatingFileHandler:
    """The rotating handler for `path`.

    Raises:
        OSError: ELOOP when `path` is a symlink (the caller reports it and refuses to start).
    """
    return SafeRotatingFileHandler(str(path))
