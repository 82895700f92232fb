"""Exchanges of Python objects over logical ranks: what torch.distributed's object collectives and the
unequal all-to-alls are built on.

Each rank contributes one picklable payload; after the flush every op's `result` is the N payloads' pickles,
in rank order, and each caller unpickles what it keeps (a copy of its own, as a separate process would get,
so that no two workers of an agent share a received object). Between agents the pickles travel over the
agents' own group as CPU bytes (gloo), as torch's object collectives carry them: peers of one job trust each
other's pickles (torch's documented model), and nothing of it goes near the control plane.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from elasticd.agent.comm.collectives import Collective, FlushEnv


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    pickle.Pickler(buf).dump(obj)
    return buf.getvalue()


def loads(data: bytes, device: torch.device | None = None) -> Any:
    """An object from `dumps`; tensors in it come back on `device` when given (torch's `device=` argument)."""
    obj = pickle.loads(data)  # noqa: S301 - peers of one job, as torch's object collectives
    if device is not None:
        obj = _to(obj, device)
    return obj


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, list):
        return [_to(x, device) for x in obj]
    if isinstance(obj, tuple):
        return tuple(_to(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


@dataclass(slots=True)
class Exchange(Collective):
    """`what` names the torch function, so that two ranks calling different ones at the same point fail
    the flush's check instead of mixing payloads."""

    op: ClassVar[str] = "exchange"
    what: str = ""
    payload: bytes = b""

    def signature(self) -> tuple:
        return (self.op, self.what)

    @classmethod
    def flush(cls, ops: list[Collective], env: FlushEnv) -> None:
        mine = [o.payload for o in ops]  # type: ignore[attr-defined]
        if env.phys.world == 1:
            every = mine
        else:
            blobs = env.phys.all_gather_bytes(dumps(mine))
            per_agent = [pickle.loads(b) for b in blobs]  # noqa: S301 - lists of bytes from our own dumps
            every = [p for agent in per_agent for p in agent]
        if len(every) != env.workers:
            raise RuntimeError(f"elasticd: an object exchange gathered {len(every)} payloads for {env.workers} ranks")
        for o in ops:
            o.result = every
