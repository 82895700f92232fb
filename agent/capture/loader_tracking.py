"""Plain DataLoader iterators (`it = iter(loader)`, `for batch in loader`) resumed at their position.

A function that walks its DataLoader itself instead of through `ctx.batches` would, once re-entered after
a resize, start the data again from the beginning. So `DataLoader.__iter__` is hooked in worker threads:
each loader the worker iterates is tracked (in the order of its first iteration), with the latest
iterator's position (batches taken), the sampler's epoch, and the random states the iterator drew from
(the worker's torch stream and the loader's and sampler's own generators) at its creation and just before
its first batch. At a resize the k-th loader's saved state goes into the worker's snapshot; on re-entry
the k-th loader the rank iterates gets an iterator rebuilt from those states and fast-forwarded to the
position, so the next batch is the one DDP would have loaded. A loader that can save its own position
(`state_dict()` / `load_state_dict()`, e.g. torchdata's StatefulDataLoader) is restored through them.

An iterator that was already dropped (a finished `for` loop, an evaluation pass) or exhausted at the
snapshot is not resumed: the next iteration starts a fresh one, with the generators where they were.
An epoch counter that a `for` statement drives (`for epoch in range(E)`) restarts at the resize with its
iterator (function_locals.py carries plain values, not iterators), so a resumed loader's sampler refuses a
later `set_epoch` that does not move past the epoch it was resumed in.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from elasticd.agent import patches
from elasticd.agent.worker import current_worker

_LEDGER = patches.ledger("capture.loader_tracking")

if TYPE_CHECKING:
    from elasticd.agent.worker import Worker


class Tracked:
    """The iterator the user gets: the loader's own, counting the batches taken from it."""

    def __init__(self, inner: Iterator[Any], track: LoaderTrack) -> None:
        self._inner = inner
        self._track = track
        self.taken = 0
        self.exhausted = False
        self.marked: int | None = None            # `taken` at the step's last backward
        self.since_mark: list[dict[str, Any]] = []  # random states before each batch taken since then
        self.refetch: list[dict[str, Any]] = []     # resumed: the states those batches were first taken with

    def __iter__(self) -> Tracked:
        return self

    @property
    def loader(self) -> Any:
        return self._track.loader

    @property
    def loader_index(self) -> int:
        """Its loader's place among those the worker iterated in this run (the order a snapshot saves)."""
        return self._track.index

    def resumable(self) -> bool:
        """Its loader's latest iterator, not run out: the one a snapshot resumes."""
        return not self.exhausted and self._track.latest() is self

    def __next__(self) -> Any:
        states = _rng_states(self._track.loader)
        if self.taken == 0 and self._track.latest() is self:
            self._track.first_rng = states
        self.since_mark.append(states)
        live = None
        if self.refetch:
            # Taken again after resuming: draw as the first time; the worker's stream already holds the draws.
            live = torch.get_rng_state()
            _set_rng_states(self._track.loader, self.refetch.pop(0))
        try:
            batch = next(self._inner)
        except StopIteration:
            self.exhausted = True
            raise
        finally:
            if live is not None:
                torch.set_rng_state(live)
        self.taken += 1
        return batch

    def __len__(self) -> int:
        return len(self._inner)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _generators(loader: Any) -> list[torch.Generator | None]:
    sampler = getattr(loader, "sampler", None)
    batch_sampler = getattr(loader, "batch_sampler", None)
    inner = getattr(batch_sampler, "sampler", None)
    return [getattr(loader, "generator", None), getattr(sampler, "generator", None), getattr(inner, "generator", None)]


def _rng_states(loader: Any) -> dict[str, Any]:
    gens = [g.get_state() if isinstance(g, torch.Generator) else None for g in _generators(loader)]
    return {"torch": torch.get_rng_state(), "generators": gens}


def _set_rng_states(loader: Any, states: dict[str, Any], with_torch: bool = True) -> None:
    if with_torch:
        torch.set_rng_state(states["torch"])
    for g, s in zip(_generators(loader), states["generators"], strict=True):
        if isinstance(g, torch.Generator) and s is not None:
            g.set_state(s)


class LoaderTrack:
    """One DataLoader a worker iterates: its latest iterator and how it was made."""

    def __init__(self, loader: Any, index: int) -> None:
        self.loader = loader
        self.index = index
        self._latest: weakref.ref[Tracked] | None = None
        self.epoch: int | None = None
        self.made_rng: dict[str, Any] | None = None
        self.first_rng: dict[str, Any] | None = None

    def latest(self) -> Tracked | None:
        return self._latest() if self._latest is not None else None

    def iterate(self, original: Any) -> Tracked:
        self.epoch = getattr(getattr(self.loader, "sampler", None), "epoch", None)
        self.made_rng, self.first_rng = _rng_states(self.loader), None
        it = Tracked(original(self.loader), self)
        self._latest = weakref.ref(it)
        return it

    def state(self, backward_seen: bool) -> dict[str, Any]:
        """What resuming needs; `live` is False when there is no iterator mid-way to resume.

        `backward_seen`: the step ran a backward pass. Batches taken after the step's last one are the next
        step's (`for batch in loader:` takes the batch before `ctx.steps` reaches the boundary): the resumed
        iterator stops short of them, so the re-entered loop takes them again.
        """
        if hasattr(self.loader, "state_dict") and hasattr(self.loader, "load_state_dict"):
            return {"own": self.loader.state_dict(), "live": False}
        it = self.latest()
        if it is None or it.exhausted or self.made_rng is None:
            return {"live": False, "generators": _rng_states(self.loader)["generators"]}
        position = (it.marked or 0) if backward_seen else it.taken
        refetch = it.since_mark[len(it.since_mark) - (it.taken - position):] if it.taken > position else []
        return {"live": True, "epoch": self.epoch, "position": position, "made_rng": self.made_rng,
                "first_rng": self.first_rng, "refetch": refetch}

    def resume(self, saved: dict[str, Any], original: Any) -> Iterator[Any]:
        """The first iteration after a resize: the iterator the snapshot left, at its position."""
        if "own" in saved:
            self.loader.load_state_dict(saved["own"])
            return self.iterate(original)
        if not saved["live"]:
            _set_rng_states(self.loader, {"generators": saved["generators"]}, with_torch=False)
            return self.iterate(original)
        sampler = getattr(self.loader, "sampler", None)
        if saved["epoch"] is not None and sampler is not None:
            sampler.epoch = saved["epoch"]
            _guard_epoch(sampler, saved["epoch"], self.index)
        # The iterator's random draws were made from the worker's stream as it was then; the stream has
        # moved on since, and the function right after resuming must see it where it is now.
        live = torch.get_rng_state()
        _set_rng_states(self.loader, saved["made_rng"])
        it = self.iterate(original)
        it.taken = 0
        if saved["position"] > 0:
            _set_rng_states(self.loader, saved["first_rng"])
            for _ in range(saved["position"]):
                next(it._inner)
            it.taken = saved["position"]
        self.made_rng, self.first_rng = saved["made_rng"], saved["first_rng"]
        it.refetch = list(saved["refetch"])
        torch.set_rng_state(live)
        return it


def _guard_epoch(sampler: Any, resumed: int, index: int) -> None:
    """A later set_epoch(e <= resumed) means the loop's epoch counter restarted with the function."""
    original = type(sampler).set_epoch

    def set_epoch(epoch: int) -> None:
        if epoch <= resumed:
            raise RuntimeError(
                f"elasticd resumed DataLoader #{index + 1} of this rank in epoch {resumed} after a resize, and now "
                f"its sampler is set to epoch {epoch}: the epoch counter in your loop (a `for` over a range or a "
                f"count) started again when the function was re-entered, so this would repeat data DDP would not. "
                f"Derive the epoch from ctx.step (e.g. ctx.step // len(loader)) or use ctx.batches(loader)")
        del sampler.set_epoch  # back to the class's method: the check holds until the epoch moves on
        original(sampler, epoch)

    sampler.set_epoch = set_epoch


class LoaderTracks:
    """A worker's tracked loaders, and the saved states its re-entered function's loaders resume from."""

    def __init__(self) -> None:
        self.tracks: list[LoaderTrack] = []
        self.skip: set[int] = set()  # loaders walked by ctx.batches, which keeps its own position
        self.saved: list[dict[str, Any]] = []
        self.backward_seen = False   # in the current step
        self._taken: set[int] = set()    # saved states a loader of this run resumed from
        self._next: int | None = None    # the saved state the next new loader resumes from (`resume_next`)

    def after_backward(self) -> None:
        """The step's batches so far are consumed by it."""
        self.backward_seen = True
        for t in self.tracks:
            it = t.latest()
            if it is not None:
                it.marked, it.since_mark = it.taken, []

    def new_step(self) -> None:
        self.backward_seen = False
        for t in self.tracks:
            it = t.latest()
            if it is not None:
                it.marked, it.since_mark = None, []

    def resume_next(self, index: int) -> None:
        """The next loader iterated for the first time in this run resumes the `index`-th saved state: the
        loader of an iterator function_locals.py makes again before the function iterates any (which may
        be another loader than its first in the run that saved them)."""
        self._next = index

    def iterate(self, loader: Any, original: Any) -> Iterator[Any]:
        for t in self.tracks:
            if t.loader is loader:
                return t.iterate(original)
        track = LoaderTrack(loader, len(self.tracks))
        self.tracks.append(track)
        # In the order the re-entered function iterates them, loaders take the saved states not yet taken.
        index, self._next = self._next, None
        if index is None:
            index = 0
            while index in self._taken:
                index += 1
        self._taken.add(index)
        if index < len(self.saved):
            return track.resume(self.saved[index], original)
        return track.iterate(original)

    def save(self) -> list[dict[str, Any]]:
        return [t.state(self.backward_seen) for t in self.tracks]


def _hook(cls: type) -> None:
    original = cls.__dict__["__iter__"]
    if getattr(original, "_elasticd_tracked", False):
        return

    @functools.wraps(original)
    def __iter__(self: Any) -> Any:
        w: Worker | None = current_worker()
        if w is None or w.capture.loader_tracks is None or id(self) in w.capture.loader_tracks.skip or type(self).__iter__ is not __iter__:
            return original(self)  # not a worker, ctx.batches' own loader, or a subclass's __iter__ calling up
        return w.capture.loader_tracks.iterate(self, original)

    __iter__._elasticd_tracked = True  # type: ignore[attr-defined]
    _LEDGER.set(cls, "__iter__", __iter__)


def install() -> None:
    """Hook DataLoader.__iter__, and that of every subclass defining its own (e.g. torchdata's
    StatefulDataLoader, imported by the script before the runtime starts); idempotent. Iterators made
    outside worker threads are untouched."""
    todo: list[type] = [DataLoader]
    while todo:
        cls = todo.pop()
        if "__iter__" in cls.__dict__:
            _hook(cls)
        todo.extend(cls.__subclasses__())
