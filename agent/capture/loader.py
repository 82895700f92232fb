"""`ctx.batches(loader)`: an endless, resumable walk over a DataLoader, epoch after epoch.

The position (epoch, batches taken in it) is part of a worker's private state, so after a resize the
walk continues at the next unseen batch: no sample skipped or repeated.

The epochs are the user's: the walk starts in the epoch the sampler holds (0, or what the user set with
`sampler.set_epoch` before), and an epoch the user sets while walking is kept, the walk counting on from
it. Setting epoch 0 over the user's own would silently change the data order a DDP run would see.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


class ResumableBatches:
    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self._seen = self._sampler_epoch()  # what the sampler held when we last looked: a change is the user's
        self.epoch = self._seen if self._seen is not None else 0
        self.position = 0  # batches already taken in this epoch
        self._restored = False
        self._it: Iterator[Any] | None = None

    def _sampler_epoch(self) -> int | None:
        epoch = getattr(getattr(self.loader, "sampler", None), "epoch", None)
        return epoch if isinstance(epoch, int) else None

    def __iter__(self) -> ResumableBatches:
        return self

    def __next__(self) -> Any:
        while True:
            if self._it is None:
                self._it = self._start_epoch()
            try:
                batch = next(self._it)
            except StopIteration:
                self._it = None
                self.epoch += 1
                self.position = 0
                continue
            self.position += 1
            return batch

    def _start_epoch(self) -> Iterator[Any]:
        sampler = getattr(self.loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            current = self._sampler_epoch()
            if not self._restored and current is not None and current != self._seen:
                self.epoch = current  # the user set it since: theirs wins
            self._restored = False
            sampler.set_epoch(self.epoch)
            self._seen = self._sampler_epoch()
        if self.position == 0:
            return iter(self.loader)
        # Resuming mid-epoch. The original run created this epoch's iterator (which draws a seed from
        # the global generator) and loaded these batches before the snapshot, so their random draws
        # are already in the restored stream: redo them with the stream put back afterwards.
        state = torch.get_rng_state()
        it = iter(self.loader)
        for _ in range(self.position):
            next(it)
        torch.set_rng_state(state)
        return it

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._restored = True  # the saved epoch wins over what the re-entered function set before the loop
        self._it = None
