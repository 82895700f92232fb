"""Text from the island (job names, error messages, tracebacks, node ids, agents' output) made safe for a
terminal or a log file.

Any peer that may submit a job chooses its name, and any job chooses its error message: printed raw,
an escape sequence in them could rewrite the operator's screen or title bar.
Control characters are shown as \\xNN escapes, like Python's repr does; `--json` output needs none of
this (json.dumps escapes them already).
"""

from __future__ import annotations

import re
import sys

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROL_BUT_NEWLINE = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")
_CONTROL_BUT_LAYOUT = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")   # tabs and newlines kept


def _escape(m: re.Match[str]) -> str:
    return f"\\x{ord(m.group()):02x}"


def printable(value: object, *, keep_newlines: bool = False, keep_tabs: bool = False) -> str:
    """`value` as text with every control character escaped (newlines, and tabs, kept if asked)."""
    pattern = (_CONTROL_BUT_LAYOUT if keep_tabs else _CONTROL_BUT_NEWLINE) if keep_newlines else _CONTROL
    return pattern.sub(_escape, str(value))


def say(line: str) -> None:
    """Write `line` and its newline to stderr in one write: stderr is unbuffered under PYTHONUNBUFFERED (as
    agents run), where `print` writes the text and the newline apart, and the job's own output, sharing the
    stream, could land between them."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
