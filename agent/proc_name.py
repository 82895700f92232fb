"""An agent's process name, as `ps -o comm`, `top` and psutil's `name()` show it: which agent it is.

Agents that `elasticd run` forks from its fork server (agent/forkserver.py) all carry the server's command
line, and a daemon's spare carries the spare's, so the command line no longer says which agent a process
is. The name does: `elasticd r<R>` for the agent of physical rank R, `elasticd spare` for a warm standby.
Linux only (the main thread's name, at most 15 bytes); elsewhere a no-op.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import psutil

PREFIX = "elasticd r"
STANDBY = "elasticd spare"


def name_of(rank: int, standby: bool) -> str:
    return STANDBY if standby else f"{PREFIX}{rank}"


def set_name(rank: int, standby: bool) -> None:
    """Name this process from any of its threads (a resize renames it from a worker's)."""
    try:
        with open(f"/proc/self/task/{os.getpid()}/comm", "w") as f:
            f.write(name_of(rank, standby)[:15])
    except OSError:
        pass   # not Linux, or no /proc: a cosmetic, never a reason for an agent to fail


def rank_of(name: str) -> int | None:
    """The physical rank a process name gives (None: not a job's agent, or a standby)."""
    if name.startswith(PREFIX) and name[len(PREFIX):].isdigit():
        return int(name[len(PREFIX):])
    return None


def is_agent(name: str) -> bool:
    return name == STANDBY or rank_of(name) is not None


def agents_under(pid: int) -> list[tuple[int | None, psutil.Process]]:
    """The agents below a launcher (or daemon) process, directly or through its fork server, each with the
    rank its name gives (None: a standby). An agent's DataLoader workers inherit its name; their parent is
    the agent, so they are left out."""
    import psutil

    try:
        kids = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []
    names: dict[int, str] = {}
    for k in kids:
        try:
            names[k.pid] = k.name()
        except psutil.Error:
            continue
    out = []
    for k in kids:
        name = names.get(k.pid, "")
        try:
            parent = k.ppid()
        except psutil.Error:
            continue
        if is_agent(name) and not is_agent(names.get(parent, "")):
            out.append((rank_of(name), k))
    return out
