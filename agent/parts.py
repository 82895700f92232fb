"""The parts of a resize snapshot (agent/fallback.py), named without torch: the scheduler reads them too."""

from __future__ import annotations

GROUPS = -1   # the replicated state; logical ranks' own parts are the ranks themselves (>= 0)


def missing(workers: int, have: list[int] | set[int]) -> list[int]:
    """Parts a complete snapshot of a job with `workers` logical ranks has that `have` lacks."""
    return sorted({GROUPS, *range(workers)} - set(have))


def describe(parts: list[int]) -> str:
    ranks = [r for r in parts if r != GROUPS]
    what = ["the replicated state"] if GROUPS in parts else []
    if ranks:
        what.append(f"logical rank(s) {ranks}")
    return " and ".join(what)
