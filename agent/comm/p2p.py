"""Point-to-point messages between logical ranks: send, recv and their asynchronous forms.

A send is buffered: the tensor is copied and the sender goes on, which any program that works with torch's
sends also does. Between two workers of one agent the copy waits in a mailbox; to a rank on another agent it
travels as a CPU tensor over the agents' group (gloo on every backend), tagged with the two logical ranks and
the user's tag, so that messages between different pairs never match. A receive takes the messages of its
(source, tag) in the order they were sent. A worker whose message is not there yet gives up the baton
(slicer/baton.py `block`): a hosted sender hands it back by delivering, a message from another agent by
arriving while the agent waits for it (`Idle`). When every hosted worker waits and none waits for another
agent, no order of the remaining sends could help, under torchrun either: the job fails naming who waits
for whom instead of hanging.

Messages are not part of snapshots: one still in flight at a step boundary where the job resizes or takes a
snapshot refuses that resize (or that snapshot), naming the two ranks.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from elasticd.core.errors import JobError

if TYPE_CHECKING:
    from elasticd.agent.runtime import Runtime
    from elasticd.agent.worker import Worker

_GRACE_S = 5.0   # at a snapshot, how long a send to another agent may take to be received before it counts as left over


_TAG_SPACE = 2 ** 30


class Deadlock(JobError, RuntimeError):
    """Every hosted worker waits, and no message any of them waits for can come."""


Key = tuple[int, int, int]   # (source rank, destination rank, tag)


class _Transfer:
    """A physical send or receive, waited for on a thread of its own: gloo marks its point-to-point work
    complete only inside `wait()`, so polling it would never see it finish."""

    def __init__(self, work: Any, finish: Any) -> None:
        self.done = threading.Event()
        self.error: BaseException | None = None
        self._work, self._finish = work, finish
        threading.Thread(target=self._wait, name="elasticd-p2p", daemon=True).start()

    def _wait(self) -> None:
        try:
            self._finish(self._work)
        except BaseException as e:  # noqa: BLE001 - raised in the worker that takes the message
            self.error = e
        self.done.set()

    def result(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


@dataclass(slots=True)
class Receive:
    """A receive a worker posted: the `index`-th message of `key`, into `target`."""

    key: Key
    index: int
    target: torch.Tensor
    remote: tuple[_Transfer, torch.Tensor] | None = None   # the physical receive and its CPU buffer
    delivered: bool = False


@dataclass(slots=True)
class _Mailbox:
    messages: dict[Key, dict[int, torch.Tensor]] = field(default_factory=dict)
    sent: Counter = field(default_factory=Counter)      # messages sent so far per key, between hosted ranks
    posted: Counter = field(default_factory=Counter)    # receives posted so far per key


class PointToPoint:
    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        self.box = _Mailbox()
        self.waiting: dict[int, Receive] = {}     # rank -> the receive it is blocked on
        self.open: dict[int, list[Receive]] = {}  # rank -> receives posted and not yet delivered
        self._sends: list[tuple[_Transfer, torch.Tensor, Key]] = []   # sends to other agents in flight

    # -- the two halves ------------------------------------------------------------------------
    def send(self, w: Worker, tensor: torch.Tensor, dst: int, tag: int) -> None:
        self._check_peer(w, dst, "dst")
        key = (w.rank, dst, tag)
        if dst in self.rt.hosted:
            index = self.box.sent[key]
            self.box.sent[key] += 1
            self.box.messages.setdefault(key, {})[index] = tensor.detach().clone()
            pending = self.waiting.get(dst)
            if pending is not None and self.ready(pending):
                self.rt.baton.unblock(dst)
            return
        buf = tensor.detach().to("cpu", copy=True).contiguous()
        work = self.rt.phys.isend(buf, self.rt.env.owner(dst), self._tag(key))
        self._sends.append((_Transfer(work, self.rt.phys.finish_p2p), buf, key))
        self._reap()

    def post(self, w: Worker, tensor: torch.Tensor, src: int, tag: int) -> Receive:
        self._check_peer(w, src, "src")
        key = (src, w.rank, tag)
        index = self.box.posted[key]
        self.box.posted[key] += 1
        rec = Receive(key, index, tensor)
        if src not in self.rt.hosted:
            buf = torch.empty(tensor.shape, dtype=tensor.dtype)
            work = self.rt.phys.irecv(buf, self.rt.env.owner(src), self._tag(key))
            rec.remote = (_Transfer(work, self.rt.phys.finish_p2p), buf)
        self.open.setdefault(w.rank, []).append(rec)
        return rec

    def wait(self, w: Worker, rec: Receive) -> None:
        """Block `w` until `rec`'s message is there, then deliver it."""
        if rec.delivered:
            return
        if not self.ready(rec):
            self.waiting[w.rank] = rec
            try:
                self.rt.block(w)
            finally:
                del self.waiting[w.rank]
        self._deliver(w, rec)

    def ready(self, rec: Receive) -> bool:
        if rec.remote is not None:
            return rec.remote[0].done.is_set()
        return rec.index in self.box.messages.get(rec.key, {})

    def _deliver(self, w: Worker, rec: Receive) -> None:
        if rec.remote is not None:
            transfer, buf = rec.remote
            transfer.result()   # raises if the transfer failed
            rec.target.copy_(buf)
        else:
            got = self.box.messages[rec.key].pop(rec.index)
            if got.shape != rec.target.shape and got.numel() != rec.target.numel():
                raise ValueError(f"recv: logical rank {rec.key[0]} sent {tuple(got.shape)} to rank {rec.key[1]}, "
                                 f"which receives into {tuple(rec.target.shape)}")
            rec.target.copy_(got.reshape(rec.target.shape))
        rec.delivered = True
        self.open[w.rank].remove(rec)

    # -- nobody can run ------------------------------------------------------------------------
    def await_message(self, blocked: tuple[int, ...], aborted: Any) -> int:
        """The first of the `blocked` ranks whose message is there, waiting for one from another agent.

        Raises:
            Deadlock: every blocked rank waits for a hosted sender, which cannot run.
        """
        waits = {r: self.waiting[r] for r in blocked}
        if all(rec.remote is None for rec in waits.values()):
            for r, rec in waits.items():
                if self.ready(rec):
                    return r
            who = "; ".join(f"logical rank {r} waits in recv from rank {rec.key[0]} (tag {rec.key[2]})"
                            for r, rec in waits.items())
            raise Deadlock(f"elasticd: point-to-point deadlock: {who}, and no rank that could send it can run "
                           f"(each waits for a message, at a collective, or returned). This order of sends, "
                           f"receives and collectives deadlocks under torchrun as well.")
        pause = 0.0001
        while True:
            for r, rec in waits.items():
                if self.ready(rec):
                    return r
            if aborted():
                return -1
            time.sleep(pause)
            pause = min(pause * 2, 0.005)

    # -- snapshots -----------------------------------------------------------------------------
    def in_flight(self, rank: int) -> str | None:
        """Why `rank`'s state cannot be snapshotted at this boundary (a message that a resize would lose)."""
        for (src, dst, tag), held in self.box.messages.items():
            if held and rank in (src, dst):
                return (f"a message from logical rank {src} to rank {dst} (tag {tag}) is sent and not received "
                        f"at this step boundary, and messages are not carried across a resize or snapshot. "
                        f"Receive each message in the step that sends it")
        for rec in self.open.get(rank, []):
            return (f"logical rank {rank} posted a receive from rank {rec.key[0]} (tag {rec.key[2]}) it has not "
                    f"waited for by this step boundary; wait for each receive in the step that posts it")
        deadline = time.monotonic() + _GRACE_S
        while any(key[0] == rank for _, _, key in self._sends):
            self._reap()
            mine = [key for _, _, key in self._sends if key[0] == rank]
            if not mine:
                break
            if time.monotonic() > deadline:
                src, dst, tag = mine[0]
                return (f"a message from logical rank {src} to rank {dst} (tag {tag}) was not received within "
                        f"{_GRACE_S:.0f} s of this step boundary, and messages are not carried across a resize "
                        f"or snapshot. Receive each message in the step that sends it")
            time.sleep(0.001)
        return None

    # -- helpers -------------------------------------------------------------------------------
    def _reap(self) -> None:
        done = [s for s in self._sends if s[0].done.is_set()]
        for s in done:
            self._sends.remove(s)
            s[0].result()

    def _tag(self, key: Key) -> int:
        """The physical tag of a (source, destination, tag): users' tags below 2**30, subgroups' channels
        (negative tags, compat/dist_groups.py) above, so the two never match."""
        src, dst, tag = key
        n = self.rt.workers
        physical = ((tag if tag >= 0 else -1 - tag) * n + src) * n + dst
        if physical >= _TAG_SPACE:
            raise ValueError(f"elasticd: tag {tag} is too large for {n} logical ranks (tag x N x N must stay "
                             f"below 2**30)")
        return physical if tag >= 0 else _TAG_SPACE + physical

    def _check_peer(self, w: Worker, peer: int, what: str) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self.rt.workers:
            raise ValueError(f"{what}={peer!r} is not a logical rank of {self.rt.workers}")
        if peer == w.rank:
            raise ValueError(f"Invalid {'destination' if what == 'dst' else 'source'} rank: should not be the "
                             f"same as the rank of the current process (logical rank {w.rank}).")
