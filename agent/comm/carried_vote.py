"""The step-boundary vote carried inside the gradient flush, so a step with a flush costs no extra round trip.

The agents' vote is a maximum over agents of small non-negative integers (resize/stop, periodic-snapshot
flag), but the gradient flush is a sum. A value v <= L travels as L "thermometer" elements, element k
being 1 when v >= k: summed over agents, element k counts the agents voting at least k, so the maximum
is the number of non-zero sums. Counts up to M are exact in fp32/fp64, and nothing else is added to
those elements.

Which boundary a carried vote decides must be the same on every agent (boundary.py's docstring: a vote
may not cross another physical collective). The carrying flush records how many whole-group
collectives the agent had run after it, and the step it was cast for; the boundary takes it only if
no whole-group collective came between, and the step matches. The sequence of whole-group collectives
is identical on every agent (it is one sequence over one group), so every agent takes the carried vote,
or every agent discards it and votes apart, at the same boundary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from elasticd.agent.comm import host_values

# Element dtypes whose sums of 0/1 over up to 2**24 agents are exact integers.
CARRIERS = (torch.float32, torch.float64)


def encode(values: Sequence[int], levels: Sequence[int]) -> list[float]:
    out: list[float] = []
    for v, top in zip(values, levels, strict=True):
        if not 0 <= v <= top:
            raise ValueError(f"vote {v} outside 0..{top}")
        out += [1.0 if v >= k else 0.0 for k in range(1, top + 1)]
    return out


def decode(sums: Sequence[float], levels: Sequence[int]) -> tuple[int, ...]:
    out, at = [], 0
    for top in levels:
        out.append(sum(1 for s in sums[at:at + top] if s > 0.5))
        at += top
    return tuple(out)


@dataclass(slots=True)
class _Decided:
    step: int
    after: int      # the agent's count of whole-group collectives right after the carrying flush
    values: tuple[int, ...]


class CarriedVote:
    """Between the step boundary (which casts and takes votes) and the gradient flush (which carries them).

    `cast` is set by the boundary: it returns (step, this agent's values) for the boundary that ends
    the step in progress, or None when no vote can be carried now (before `ctx.steps`).
    """

    def __init__(self, levels: Sequence[int]) -> None:
        self.levels = tuple(levels)
        self.width = sum(self.levels)
        self.cast: Callable[[], tuple[int, tuple[int, ...]] | None] | None = None
        self._open: tuple[int, tuple[int, ...]] | None = None   # cast into the flush under way
        self._decided: _Decided | None = None

    def ballot(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """The elements to append to a flush's buffer of `dtype`, or None (not this buffer, or no vote)."""
        if self.cast is None or self._open is not None or dtype not in CARRIERS:
            return None
        got = self.cast()
        if got is None:
            return None
        self._open = got
        return host_values.to_device(encode(got[1], self.levels), dtype, device)

    def summed(self, sums: list[float]) -> None:
        """The ballot's elements after the sum over agents (read back with the flush's other values)."""
        assert self._open is not None
        step, _ = self._open
        self._decided = _Decided(step, -1, decode(sums, self.levels))

    def end_flush(self, collectives: int) -> None:
        """The flush is over; `collectives`: the agent's count of whole-group collectives so far."""
        self._open = None
        if self._decided is not None and self._decided.after < 0:
            self._decided.after = collectives

    def take(self, step: int, collectives: int) -> tuple[int, ...] | None:
        """The agreed values for the boundary after `step` if the last whole-group collective carried them."""
        d, self._decided = self._decided, None
        if d is None or d.step != step or d.after != collectives:
            return None
        return d.values
