"""The parts of a resize snapshot (agent/resize/fallback.py): names and listings without torch, for the daemon,
the scheduler and `elasticd run`, which do not import it."""

from __future__ import annotations

import os
import re
from pathlib import Path

GROUPS = -1   # the replicated state; logical ranks' own parts are the ranks themselves (>= 0)
_PART = re.compile(r"^(?:w(\d+)|groups)\.pt$")


def epoch_dir(root: str | os.PathLike[str], epoch: int) -> Path:
    return Path(root) / f"e{epoch}"


def part_name(part: int) -> str:
    return "groups.pt" if part == GROUPS else f"w{part}.pt"


def parts(root: str | os.PathLike[str], epoch: int) -> list[int]:
    """The parts of epoch `epoch` saved under `root` (logical ranks, and GROUPS), sorted."""
    try:
        names = os.listdir(epoch_dir(root, epoch))
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


def missing(workers: int, have: list[int] | set[int]) -> list[int]:
    """Parts a complete snapshot of a job with `workers` logical ranks has that `have` lacks."""
    return sorted({GROUPS, *range(workers)} - set(have))


def describe(parts: list[int]) -> str:
    ranks = [r for r in parts if r != GROUPS]
    what = ["the replicated state"] if GROUPS in parts else []
    if ranks:
        what.append(f"logical rank(s) {ranks}")
    return " and ".join(what)
