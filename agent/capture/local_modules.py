"""Modules the function holds in its variables that nothing else carries, carried across resizes by name.

DINO (facebookresearch/dino, main_dino.py) builds its teacher as a second network that loads the student's
weights (`teacher.load_state_dict(student.state_dict())`), not as a `copy.deepcopy`, and moves it towards
the student at every step (`param_k.data.mul_(m).add_(...)`); its loss is a module whose `center` buffer
the loop updates. Neither is replicated, private or a tracked copy (capture/carried.py), so a resized DINO
job re-entered its function with a fresh teacher and a zero center: 0.98 from DDP, exit 0.

At the start of `ctx.steps` each module a variable holds (a local, or an attribute function_locals looks
into) whose tensors nothing else carries is noted with a fingerprint of each parameter and buffer: its
identity, version and a CRC of up to 4 096 evenly spaced elements (a frozen text encoder of a diffusion job
is read in a few thousand places per tensor, not whole, at every snapshot). A snapshot copies the
`state_dict()` of those the loop changed (a buffer rebound, a value written, also through `.data`, which
moves no version: an EMA moves every element), and the resumed function's module under the same name loads
it where its `ctx.steps` begins. Frozen modules (a perceptual-loss network) are not copied. A module first
made inside the loop is not carried: it is made again at every step anyway. Not seen: a write through
`.data` to a few elements the samples miss.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from elasticd.agent.capture.carried import NotCarried, _Copy, _target, absorb, snapshot_state
from elasticd.agent.capture.local_arrays import fingerprint, writes
from elasticd.agent.capture.tensor_containers import storage

if TYPE_CHECKING:
    from elasticd.agent.worker import Worker


def _tensors(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(itertools.chain(module.named_parameters(), module.named_buffers()))


def _storages(m: Any) -> set[int]:
    if isinstance(m, torch.nn.Module):
        found = {storage(t) for _, t in _tensors(m)}
    elif isinstance(m, torch.Tensor):
        found = {storage(m)}
    elif isinstance(m, dict | list | tuple):
        found = {storage(t) for t in (m.values() if isinstance(m, dict) else m) if isinstance(t, torch.Tensor)}
    else:
        found = set()
    found.discard(0)
    return found


class _Elsewhere:
    """Where the tensors that other means carry live: replicated, private, tracked objects and copies."""

    def __init__(self, w: Worker) -> None:
        rt = getattr(w.ctx, "_rt", None)
        self.base: set[int] = set()
        for m in [g.model for g in getattr(rt, "groups", [])] + list(w.progress.private):
            self.base |= _storages(m)
        self.copies: dict[int, set[int]] = {}   # id of a tracked copy -> its storages
        for made in w.capture.created:
            target = _target(made)
            if isinstance(made, _Copy) and target is not None:
                self.copies[id(target)] = _storages(target)
            else:
                self.base |= _storages(target)

    def overlaps(self, tensors: list[tuple[str, torch.Tensor]], inside: set[int]) -> bool:
        """Whether any of `tensors` is carried otherwise, not counting the tracked copies in `inside`."""
        mine = {storage(t) for _, t in tensors}
        if mine & self.base:
            return True
        return any(mine & found for key, found in self.copies.items() if key not in inside)


def loose(named: list[tuple[str, Any]], w: Worker | None) -> dict[str, torch.nn.Module]:
    """key -> each module the variables hold that has tensors and shares none with what is carried otherwise
    (the first key of a module two variables hold: DINO's `teacher` and `teacher_without_ddp`).

    Tracked copies inside such a module (a teacher built from `copy.deepcopy(attn)` pieces) are carried with
    it, not on their own (capture/carried.py `absorb`)."""
    if w is None:
        return {}
    out: dict[str, torch.nn.Module] = {}
    seen: set[int] = set()
    elsewhere: _Elsewhere | None = None
    for key, value in named:
        if not isinstance(value, torch.nn.Module) or id(value) in seen:
            continue
        seen.add(id(value))
        tensors = _tensors(value)
        if not tensors:
            continue
        if elsewhere is None:
            elsewhere = _Elsewhere(w)
        inside = {id(m) for m in value.modules() if m is not value}
        if elsewhere.overlaps(tensors, inside):
            continue
        absorb(w, value)
        out[key] = value
    return out


def _print(module: torch.nn.Module) -> dict[str, tuple[Any, ...]]:
    return {name: (id(t), writes(t), fingerprint(t, 0)) for name, t in _tensors(module)}


class NotedModules:
    """The loose modules where the loop began, and what their tensors were."""

    def __init__(self, modules: dict[str, torch.nn.Module]) -> None:
        self.refs = {key: weakref.ref(m) for key, m in modules.items()}
        self.prints = {key: _print(m) for key, m in modules.items()}

    def save(self, named: list[tuple[str, Any]], where: Callable[[str], str]) -> dict[str, Any]:
        """key -> state_dict() copy of each noted module the loop changed.

        Raises:
            NotCarried: its state_dict() raises or holds what a snapshot cannot.
        """
        held = {key: value for key, value in named if key in self.refs}
        out = {}
        for key, ref in self.refs.items():
            module = held.get(key)
            if not isinstance(module, torch.nn.Module):
                continue
            if module is ref() and _print(module) == self.prints[key]:
                continue   # unchanged since the loop began: the resumed function builds it the same
            out[key] = snapshot_state(module, where(key))
        return out


def restore(saved: dict[str, Any], modules: dict[str, torch.nn.Module], where: Callable[[str], str]) -> None:
    """Load each saved state into the module the re-entered function holds under the same name.

    Raises:
        NotCarried: it holds none there, or one whose state does not fit.
    """
    for key, state in saved.items():
        module = modules.get(key)
        if module is None:
            raise NotCarried(
                f"{where(key)} held a module whose state the loop had changed (a teacher moved towards the "
                f"student, a buffer updated), and the resumed function holds no module there where ctx.steps "
                f"begins. Build it before ctx.steps under the same name, or pass it to ctx.private")
        try:
            module.load_state_dict(state)
        except RuntimeError as e:
            raise NotCarried(f"cannot give {where(key)} its state from before the resize: the resumed function "
                             f"built a different module there ({e})") from e
