"""The roots of every exception elasticd raises on purpose, and the exit code each means.

`ElasticdError` is the root of errors; its subclasses say whose problem it is. A class also keeps the
built-in base it always had (`StoreError` is still a `RuntimeError`), so existing handlers keep working.
`ElasticdInterrupt` is the root of what unwinds a worker's stack on purpose (a lost peer, a resize); it is a
`BaseException` so that a user's `except Exception:` cannot swallow it and train on.
"""

from __future__ import annotations

from elasticd.core.exits import EXIT_ERROR, EXIT_UNREACHABLE, EXIT_USAGE


class ElasticdError(Exception):
    """Root of elasticd's errors. `exit_code`: what a command exits with when one ends it."""

    exit_code = EXIT_ERROR


class UsageError(ElasticdError):
    """What the user asked for cannot be done as asked (a bad address, option or script)."""

    exit_code = EXIT_USAGE


class ControlPlaneError(ElasticdError):
    """The daemon, the scheduler or their state cannot do what was asked, or refused it."""


class UnreachableError(ElasticdError):
    """No daemon or scheduler answered."""

    exit_code = EXIT_UNREACHABLE


class JobError(ElasticdError):
    """The job's own code did something the runtime cannot honour as DDP would; the message names it."""


class RuntimeFault(ElasticdError):
    """The runtime's own invariant broke (a bug of ours, or its files went missing under it)."""


class ElasticdInterrupt(BaseException):  # noqa: N818 - an interrupt, as KeyboardInterrupt is
    """Root of what unwinds worker threads on purpose; never caught by user code's `except Exception`."""

    exit_code = EXIT_ERROR
