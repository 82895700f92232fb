"""What a job needs to resume at a step boundary, held in host memory.

A resize (or a stop) happens between two physical steps: every worker saves its own state (next
step, RNG streams, loader positions, metrics, private extras) and the agent saves the replicated
state once. The decorated function is then invoked again on the new layout and `ctx.replicate`,
`ctx.batches` and `ctx.steps` load from here, so the job continues exactly where it was.

Snapshots cross process boundaries only between the agents of one job, as `torch.save` bytes read
back with `weights_only=True`: plain containers and tensors, never arbitrary pickled objects.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import torch


@dataclass(slots=True)
class WorkerSnapshot:
    rank: int
    step: int                                  # the next step to run
    rng: dict[str, Any]
    loaders: list[dict[str, int]] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)  # e.g. private state, by provider name

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "step": self.step, "rng": _rng_to_plain(self.rng), "loaders": self.loaders,
                "metrics": self.metrics, "extras": self.extras}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerSnapshot:
        return cls(rank=d["rank"], step=d["step"], rng=_rng_from_plain(d["rng"]), loaders=d["loaders"],
                   metrics=d["metrics"], extras=d["extras"])


@dataclass(slots=True)
class GroupSnapshot:
    """One `ctx.replicate` call site."""

    model: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    scheduler: dict[str, Any] | None
    # The common gradient at the boundary, by trainable parameter (None: no gradient). Under DDP it carries
    # over into the next step unless the job clears it first, so it survives a resize as well.
    grads: list[torch.Tensor | None] | None = None
    # Buffers registered with persistent=False, by name: state_dict() leaves them out, but a forward may
    # change them (a running count), and DDP carries them along with the model's other buffers.
    buffers: dict[str, torch.Tensor] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def mapped(self, fn: Callable[[Any], Any]) -> GroupSnapshot:
        """The same snapshot with `fn` applied to each part (a copy, a host view)."""
        return GroupSnapshot(**{f.name: fn(getattr(self, f.name)) for f in fields(self)})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GroupSnapshot:
        return cls(model=d["model"], optimizer=d["optimizer"], scheduler=d["scheduler"], grads=d.get("grads"),
                   buffers=d.get("buffers"))


@dataclass(slots=True)
class AgentSnapshot:
    groups: list[GroupSnapshot]
    workers: dict[int, WorkerSnapshot]


def to_bytes(obj: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes) -> dict[str, Any]:
    """Always onto the CPU, whatever device the tensors were saved from or the agent runs on: RNG states
    must be CPU ByteTensors (`torch.set_rng_state`, `torch.cuda.set_rng_state`, numpy's `.numpy()`), and
    model/optimizer/private loading moves the rest to its device (`load_state_dict`, `copy_`) one tensor
    at a time instead of holding a second copy of everything on the device."""
    return _load(io.BytesIO(data))


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A snapshot part written with `torch.save` to a file, onto the CPU (see `from_bytes`)."""
    return _load(path)


def _load(f: Any) -> dict[str, Any]:
    with torch.serialization.safe_globals(_numpy_globals()):
        return torch.load(f, map_location="cpu", weights_only=True)


def _numpy_globals() -> list[Any]:
    """What numpy numbers and numeric arrays unpickle through, for weights_only loading to accept them.

    A job's optimizer or scheduler state may hold them: DINO writes `lr_schedule[it]`, a numpy float, into
    `param_groups` at every step, and the first resize after it failed to load its own snapshot
    ("Unsupported global: numpy._core.multiarray.scalar"), which ended the job. These rebuild numbers and
    arrays from their dtype and bytes; object arrays stay refused.
    """
    np = sys.modules.get("numpy")
    if np is None:
        return []
    core = getattr(np, "_core", None) or np.core
    dtypes = getattr(np, "dtypes", None)
    kinds = [] if dtypes is None else [
        t for name, t in vars(dtypes).items()
        if name.endswith("DType") and isinstance(t, type) and name not in ("ObjectDType", "VoidDType")]
    return [core.multiarray.scalar, core.multiarray._reconstruct, np.ndarray, np.dtype, *kinds]


def _rng_to_plain(rng: dict[str, Any]) -> dict[str, Any]:
    # numpy's state holds an ndarray, which weights_only loading refuses: carry it as a tensor.
    out = dict(rng)
    np_state = rng.get("numpy")
    if np_state is not None:
        name, keys, pos, has_gauss, gauss = np_state
        out["numpy"] = (name, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(gauss))
    return out


def _rng_from_plain(rng: dict[str, Any]) -> dict[str, Any]:
    out = dict(rng)
    np_state = rng.get("numpy")
    if np_state is not None and isinstance(np_state[1], torch.Tensor):
        name, keys, pos, has_gauss, gauss = np_state
        out["numpy"] = (name, keys.numpy().astype("uint32"), pos, has_gauss, gauss)
    return out
