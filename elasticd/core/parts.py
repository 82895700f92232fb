"""The parts of a snapshot: names and listings without torch, for the daemon, the scheduler and `elasticd run`,
which do not import it.

Two kinds live side by side under a job's snapshot root: `e<E>/`, the snapshot of resize E
(agent/resize/fallback.py), and `s<S>/`, a periodic snapshot from which the job resumes at step S after a
failure (agent/resize/periodic.py). Both hold the same parts: `w<rank>.pt` per logical rank, `groups.pt`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

GROUPS = -1   # the replicated state; logical ranks' own parts are the ranks themselves (>= 0)
_PART = re.compile(r"^(?:w(\d+)|groups)\.pt$")


def epoch_dir(root: str | os.PathLike[str], epoch: int) -> Path:
    return Path(root) / f"e{epoch}"


def periodic_dir(root: str | os.PathLike[str], step: int) -> Path:
    """The periodic snapshot from which the job resumes at step `step` (the next step to run)."""
    return Path(root) / f"s{step}"


def part_name(part: int) -> str:
    return "groups.pt" if part == GROUPS else f"w{part}.pt"


def parts(root: str | os.PathLike[str], epoch: int) -> list[int]:
    """The parts of epoch `epoch` saved under `root` (logical ranks, and GROUPS), sorted."""
    return parts_in(epoch_dir(root, epoch))


def parts_in(d: str | os.PathLike[str]) -> list[int]:
    """The parts saved in snapshot directory `d` (logical ranks, and GROUPS), sorted."""
    try:
        names = os.listdir(d)
    except OSError:
        return []
    found = []
    for name in names:
        m = _PART.match(name)
        if m:
            found.append(int(m.group(1)) if m.group(1) is not None else GROUPS)
    return sorted(found)


def epochs(root: str | os.PathLike[str]) -> list[int]:
    """The epochs with a snapshot directory under `root`, sorted."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(int(n[1:]) for n in names if n.startswith("e") and n[1:].isdigit())


def periodic_steps(root: str | os.PathLike[str]) -> list[int]:
    """The steps with a periodic snapshot directory under `root` (complete or not), sorted."""
    try:
        names = os.listdir(root)
    except OSError:
        return []
    return sorted(int(n[1:]) for n in names if n.startswith("s") and n[1:].isdigit())


def written(root: str | os.PathLike[str]) -> list[Path]:
    """Every snapshot directory the agents wrote under `root`, periodic and per resize: what goes from a directory
    of the user's (`elasticd run --snapshot-dir`) once nothing will resume from it, the rest staying."""
    return [periodic_dir(root, s) for s in periodic_steps(root)] + [epoch_dir(root, e) for e in epochs(root)]


def missing(workers: int, have: list[int] | set[int]) -> list[int]:
    """Parts a complete snapshot of a job with `workers` logical ranks has that `have` lacks."""
    return sorted({GROUPS, *range(workers)} - set(have))


def describe(parts: list[int]) -> str:
    ranks = [r for r in parts if r != GROUPS]
    what = ["the replicated state"] if GROUPS in parts else []
    if ranks:
        what.append(f"logical rank(s) {ranks}")
    return " and ".join(what)
