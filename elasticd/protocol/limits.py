"""Bounds on what a peer may ask for: one table, used by the wire checks (`Message.check`), the
scheduler's quotas and the CLI's option ranges, so a value the CLI accepts is never refused later
and a raw client cannot get past what the CLI would refuse.

The sizes are far above any real job (a script path of 4 KiB, 64 KiB of --env) and far below what
would let one request grow the job table or a status reply without bound.
"""

from __future__ import annotations

MAX_WORKERS = 65536            # N; also the most devices a request may name
MAX_PRIORITY = 10**6           # |--priority|
MAX_PATH = 4096                # PATH_MAX: script and cwd
MAX_NAME = 128                 # --name, node ids, function names
MAX_JOB_ID = 64
MAX_ENV_ITEMS = 256
MAX_ENV_BYTES = 64 * 1024      # keys + values of one job's --env
MAX_LOG_OFFSETS = 4096         # log files named in one `logs` request
# What one job's `ctx.log` values may take in a node's heartbeat: a job's output must never decide whether
# its node is alive (a heartbeat over the frame cap is refused, and the node would be declared lost).
MAX_METRICS = 64               # values
MAX_METRIC_CHARS = 256         # characters of one string value (a phase name, not a report)
MAX_SCALE_AT = 256             # entries of one job's --scale-at schedule
MAX_ISLAND_COUNT = 10**6       # nodes, devices or jobs an island reports
MAX_THREADS = 4096             # --threads per agent
MAX_DEVICE_MEMORY = 1 << 50    # --device-memory bytes (1 PiB)


def bad_job_id(value: str) -> str | None:
    """Why `value` is no job id (None: it is one). Letters, digits, `-` and `_` only: an id names a job's
    log and error folders as it is, so no two ids may map to one folder (`.j1` and `j1`)."""
    if not 0 < len(value) <= MAX_JOB_ID or not all(c.isascii() and (c.isalnum() or c in "-_") for c in value):
        return f"job id {value[:80]!r}: 1-{MAX_JOB_ID} letters, digits, '-' or '_'"
    return None


def bad_island_id(value: str) -> str | None:
    """Why `value` is no island id (None: it is one): 1-128 of letters, digits and `_.:-`, as node ids."""
    if not 0 < len(value) <= MAX_NAME or not all(c.isascii() and (c.isalnum() or c in "_.:-") for c in value):
        return f"island id {value[:80]!r}: 1-{MAX_NAME} letters, digits, '_', '.', ':' or '-'"
    return None


def bad_snapshot_key(value: str) -> str | None:
    """Why `value` is no snapshot key (None: it is one); a key names a directory on every node: 0-64 lowercase
    hex digits."""
    if len(value) > 64 or any(c not in "0123456789abcdef" for c in value):
        return f"snapshot key {value[:80]!r}: at most 64 lowercase hex digits"
    return None


def bad_user_name(value: str) -> str | None:
    """Why `value` is no Unix user name a job may run as (None: it is): POSIX's portable set, 1-32
    characters, not starting with '-'."""
    if not 0 < len(value) <= 32 or value[0] == "-" or not all(
            c.isascii() and (c.isalnum() or c in "._-") for c in value):
        return f"user name {value[:40]!r}: 1-32 letters, digits, '.', '_' or '-', not starting with '-'"
    return None


def bad_text(what: str, value: str, limit: int, *, path: bool = False) -> str | None:
    """Why `value` is not acceptable as `what` (None: it is): too long, NUL or other control
    characters, or (for paths) not absolute."""
    if len(value.encode("utf-8", "surrogatepass")) > limit:
        return f"{what} is longer than {limit} bytes"
    if "\x00" in value:
        return f"{what} contains a NUL character"
    if path:
        if not value.startswith("/"):
            return f"{what} must be an absolute path, got {value[:80]!r}"
    elif any(ord(c) < 32 or ord(c) == 127 for c in value):
        return f"{what} contains control characters"
    return None


def bad_agent_options(threads: int, device_memory: int) -> str | None:
    """Why per-agent --threads / --device-memory values are none (None: they are; 0 is the default)."""
    if not 0 <= threads <= MAX_THREADS:
        return f"threads must be in 0..{MAX_THREADS}, got {threads}"
    if not 0 <= device_memory <= MAX_DEVICE_MEMORY:
        return f"device_memory must be in 0..{MAX_DEVICE_MEMORY}, got {device_memory}"
    return None


def bad_scale_at(schedule: list[tuple[int, int]], workers: int) -> str | None:
    """Why a (step, devices) resize schedule is none (None: it is one): at most MAX_SCALE_AT entries,
    steps ascending and distinct, each device count in 1..workers."""
    if len(schedule) > MAX_SCALE_AT:
        return f"{len(schedule)} entries, at most {MAX_SCALE_AT} are allowed"
    last = -1
    for step, devices in schedule:
        if step <= last:
            return f"steps must be distinct and ascending, got {step} after {last}" if last >= 0 else \
                f"a step must be >= 0, got {step}"
        if not 1 <= devices <= workers:
            return f"after step {step}: devices must be in 1..{workers}, got {devices}"
        last = step
    return None
