"""Random generators the function keeps in its own variables, carried across resizes by name.

A DDP process keeps `g = torch.Generator().manual_seed(seed)`, `rng = np.random.default_rng(seed)` or
`r = random.Random(seed)` for life. Here the function is re-entered after a resize and makes them again
from their seeds, so the noise or data drawn from them would start over: a different result, exit 0.
A snapshot is taken in the worker's own thread, at a step boundary of `ctx.steps`, with the function's
frames on the stack: the generators held by their local variables are saved under (frame, name). On
re-entry, at the start of `ctx.steps`, the same frames hold the new generators under the same names, and
each gets its saved state back. Names, not creation order: torch and the standard library make
generators of their own (`RandomSampler`, `tempfile`), which would shift any count.

Not seen: generators held only inside objects (`self.rng` of a trainer) or closures, and names a frame
binds only inside the loop (made again there anyway). The process-wide streams (`torch.manual_seed`,
`random.seed`, `np.random.seed`) are carried by agent/slicer/rng.py.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import torch

_OURS = str(Path(__file__).resolve().parents[1])   # the agent package: its frames are not the function's


def _numpy() -> Any | None:
    return sys.modules.get("numpy")   # a job that never imported numpy holds no numpy generator


def _kind(obj: Any) -> str | None:
    if isinstance(obj, torch.Generator):
        return "torch"
    if isinstance(obj, random.Random) and obj is not random._inst:  # type: ignore[attr-defined]
        return "random"
    np = _numpy()
    if np is not None:
        if isinstance(obj, np.random.Generator):
            return "numpy"
        if isinstance(obj, np.random.RandomState) and obj is not np.random.mtrand._rand:
            return "numpy_legacy"
    return None


def _get(kind: str, obj: Any) -> Any:
    if kind == "torch":
        return obj.get_state()
    if kind == "random":
        return list(obj.getstate())
    if kind == "numpy":
        return _plain(obj.bit_generator.state)
    return _plain(obj.get_state(legacy=False))


def _set(kind: str, obj: Any, state: Any) -> None:
    if kind == "torch":
        obj.set_state(state)
    elif kind == "random":
        version, internal, gauss = state
        obj.setstate((version, tuple(internal), gauss))
    elif kind == "numpy":
        obj.bit_generator.state = _unplain(state)
    else:
        obj.set_state(_unplain(state))


def _plain(x: Any) -> Any:
    """numpy's state dicts hold arrays (MT19937's key); snapshots hold tensors, numbers, strings, lists, dicts."""
    np = _numpy()
    if np is not None and isinstance(x, np.ndarray):
        return {"ndarray": x.tolist(), "dtype": str(x.dtype)}
    if isinstance(x, np.integer if np is not None else ()):
        return int(x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _unplain(x: Any) -> Any:
    if isinstance(x, dict):
        if set(x) == {"ndarray", "dtype"}:
            np = _numpy()
            assert np is not None, "a numpy generator's state, with numpy gone"
            return np.asarray(x["ndarray"], dtype=x["dtype"])
        return {k: _unplain(v) for k, v in x.items()}
    return x


def _frames(stop: CodeType) -> list[FrameType]:
    """The function's frames in this thread, outermost first: everything above the worker's entry (`stop`,
    the runtime's thread body) that is not the agent's own code. Empty outside a worker's thread."""
    frames: list[FrameType] = []
    f = sys._getframe(1)
    while f is not None and f.f_code is not stop:
        if not f.f_code.co_filename.startswith(_OURS):
            frames.append(f)
        f = f.f_back
    return frames[::-1] if f is not None else []


def _held(stop: CodeType) -> dict[str, tuple[str, Any]]:
    """'frame index:function:name' -> (kind, generator) for every generator in the function's locals."""
    found = {}
    for i, frame in enumerate(_frames(stop)):
        for name, value in frame.f_locals.items():
            kind = _kind(value)
            if kind is not None:
                found[f"{i}:{frame.f_code.co_qualname}:{name}"] = (kind, value)
    return found


def save(stop: CodeType) -> dict[str, dict[str, Any]]:
    """The states of the generators the function's frames hold now (called in the worker's thread)."""
    return {key: {"kind": kind, "state": _get(kind, obj)} for key, (kind, obj) in _held(stop).items()}


def restore(stop: CodeType, saved: dict[str, dict[str, Any]]) -> None:
    """Give the generators held under the saved names their states back (at the start of ctx.steps)."""
    for key, (kind, obj) in _held(stop).items():
        entry = saved.get(key)
        if entry is not None and entry["kind"] == kind:
            _set(kind, obj, entry["state"])
