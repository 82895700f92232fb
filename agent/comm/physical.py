"""The physical process group: the M agents of a job (gloo on CPU; gloo for CPU tensors and NCCL for
CUDA tensors on CUDA).

Every physical collective of an agent goes through this class, so a world of one agent costs
nothing and the logical layer never special-cases it.

On CUDA the group is one process group with two backends, `"cpu:gloo,cuda:nccl"`: torch dispatches
each collective by the device of its tensors, so small control tensors (the step-boundary vote, the
snapshot table, user `ctx` collectives of CPU tensors) and the byte transfers of a resize stay on
the host, while gradients go over NCCL. NCCL never sees a CPU tensor (it would fail), and no side
group is needed (`new_group` must be entered by every rank, which only some agents of a resize would).
The group is bound to the agent's GPU (`device_id`), so NCCL connects eagerly on that device and
`barrier` allocates its tensor there rather than on whatever device is current.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import os
import socket
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed.distributed_c10d as dist  # unpatched: flushes run in worker threads, where torch.distributed.* is logical (agent/compat/torch_dist.py)

from elasticd.agent.comm import beat
from elasticd.agent.comm.islands import IslandGroups, emulated_islands
from elasticd.core.env_names import DEVICE_BACKEND_ENV
from elasticd.core.errors import ElasticdInterrupt
from elasticd.core.exits import EXIT_PEER_LOST

log = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class GroupSpec:
    """How the agents' process group is created for a device: what `init_process_group` and `barrier` get."""

    backend: str
    device_id: torch.device | None = None   # init_process_group(device_id=...): binds the group to the GPU
    barrier_device_ids: list[int] | None = None

    def init_kwargs(self) -> dict[str, Any]:
        return {} if self.device_id is None else {"device_id": self.device_id}

    def barrier_kwargs(self) -> dict[str, Any]:
        return {} if self.barrier_device_ids is None else {"device_ids": list(self.barrier_device_ids)}


def group_spec(device: torch.device, environ: Mapping[str, str] | None = None) -> GroupSpec:
    """The process group for agents on `device` (a pure function of the device and the environment).

    CPU: gloo. CUDA: one group, gloo for CPU tensors and NCCL for CUDA tensors, bound to the agent's GPU.
    With ELASTICD_DEVICE_BACKEND=gloo (tests: two agents on one GPU): gloo for both, not bound.

    Raises:
        ValueError: a CUDA device without an index, or an unknown ELASTICD_DEVICE_BACKEND value.
    """
    env = os.environ if environ is None else environ
    if device.type != "cuda":
        return GroupSpec("gloo")
    override = env.get(DEVICE_BACKEND_ENV, "")
    if override == "gloo":
        return GroupSpec("gloo")
    if override not in ("", "nccl"):
        raise ValueError(f"{DEVICE_BACKEND_ENV}={override!r}: expected 'nccl' (default) or 'gloo'")
    if device.index is None:
        raise ValueError(f"the agents' group needs a CUDA device with an index, got {device}")
    return GroupSpec("cpu:gloo,cuda:nccl", device_id=device, barrier_device_ids=[device.index])


class PeerLost(ElasticdInterrupt):
    """A physical collective failed: another agent of the job died or became unreachable.

    Not the user's error, and it must not look like one: the job is recovered from its last snapshot
    instead of failing (or, without recovery, the first cause is the dead agent, not this survivor).
    A BaseException, so that a user's `except Exception` around a collective cannot swallow it and train
    on with a group that no longer works.
    """

    exit_code = EXIT_PEER_LOST


@contextlib.contextmanager
def _peers(waits: bool = True) -> Iterator[None]:
    """Around a call into the group. `waits`: it blocks until the other agents take part, which the beat
    file shows (agent/comm/beat.py); a point-to-point wait, which may rightly last long, does not."""
    try:
        with beat.waiting() if waits else contextlib.nullcontext():
            yield
    except RuntimeError as e:   # gloo/NCCL: "Connection closed by peer", "Connection reset", timeouts
        # The backend's own text (a C++ source path, "GLHF") stays in the chained traceback, out of the line
        # a user reads next to the first cause.
        why = "it timed out" if "timed out" in str(e).lower() else "another agent's connection closed"
        raise PeerLost(f"a collective of the agents' group failed: {why}") from e


STORE_POLL_S = (0.001, 0.01)   # the first and the longest wait between two probes of rank 0's store


def await_store(addr: str, port: int, deadline: float) -> None:
    """Return once rank 0's rendezvous store accepts connections at addr:port (or at `deadline`: then
    init_process_group reports what is wrong, as it would have).

    Rank 0 starts the store when it enters the group, which in a resize is after its last step and its
    snapshot, while a joiner is told at the go and arrives first. c10d's client retries a refused connect
    with a growing back-off, and the whole group then forms up to 0.7 s after rank 0 is there (measured on
    loopback, 4 agents, rank 0 50 ms late); a connect of our own every few milliseconds finds the store
    within one of them. The probe's connection carries nothing and is closed at once; the store serves
    the connections that follow."""
    wait = STORE_POLL_S[0]
    while True:
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))).close()
            return
        except OSError:
            if time.monotonic() + wait > deadline:
                return
            time.sleep(wait)
            wait = min(wait * 1.5, STORE_POLL_S[1])


class PhysicalGroup:
    def __init__(self, rank: int, world: int, device: torch.device, spec: GroupSpec | None = None) -> None:
        self.rank = rank
        self.world = world
        self.device = device
        self.spec = spec if spec is not None else group_spec(device)
        self.bytes_reduced = 0  # accounting for benchmarks and tests
        self.cross_island_bytes = 0      # of those, sent to another island (comm/islands.py)
        self.cross_island_messages = 0
        # Whole-group collectives of the training so far (not point-to-point, not the side group): the
        # same sequence on every agent, so a position in it names the same moment everywhere
        # (comm/carried_vote.py).
        self.collectives = 0
        # Copies of periodic snapshots to another node run on the snapshot writer's thread while training
        # goes on: on a group of their own, so they never interleave with the training's collectives.
        self.side: Any = None
        # A job across islands (comm/islands.py): its all-reduces go in two levels.
        self.islands: IslandGroups | None = None

    @classmethod
    def connect(cls, rank: int, world: int, device: torch.device, master_addr: str, master_port: int,
                timeout_s: float = 600.0) -> PhysicalGroup:
        spec = group_spec(device)
        if world > 1:
            if master_addr in ("127.0.0.1", "localhost", "::1"):
                # gloo otherwise resolves the hostname, which in containers often points nowhere useful.
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            if rank > 0:
                await_store(master_addr, master_port, time.monotonic() + timeout_s)
            dist.init_process_group(
                spec.backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world,
                timeout=datetime.timedelta(seconds=timeout_s), **spec.init_kwargs(),
            )
            log.info("physical group up: rank %d of %d (%s)", rank, world, spec.backend)
        group = cls(rank, world, device, spec)
        if world > 1:
            group.side = dist.new_group(backend="gloo")   # entered by every agent of the new group, here
            islands = emulated_islands(world)
            if islands is not None:
                group.islands = IslandGroups(islands, rank)
        return group

    def close(self) -> None:
        if self.islands is not None:
            self.islands.close()
            self.islands = None
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.world > 1:
            self.bytes_reduced += t.numel() * t.element_size()
            self.collectives += 1
            with _peers():
                if self.islands is not None:
                    self.islands.all_reduce(t, _OPS[op]).result()
                else:
                    dist.all_reduce(t, op=_OPS[op])
        return t

    def all_reduce_start(self, t: torch.Tensor) -> Any:
        """Start a sum of `t` over the agents and return at once (gloo runs it on the group's own threads,
        NCCL on its stream); `finish` waits for it. Started ones complete in the order they were started,
        which must be the same on every agent, as for any collective."""
        if self.world == 1:
            return None
        self.bytes_reduced += t.numel() * t.element_size()
        self.collectives += 1
        if self.islands is not None:
            return _Started(self.islands.all_reduce(t, dist.ReduceOp.SUM))
        with _peers():
            return dist.all_reduce(t, op=dist.ReduceOp.SUM, async_op=True)

    def all_to_all_start(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int]
                         ) -> Any:
        """`all_to_all_` started and returned at once, as `all_reduce_start`; `finish` waits for it."""
        if self.world == 1:
            out.copy_(t)
            return None
        self.bytes_reduced += t.numel() * t.element_size()
        self.collectives += 1
        with _peers():
            return dist.all_to_all_single(out, t, out_splits, in_splits, async_op=True)

    @staticmethod
    def finish(work: Any) -> None:
        if work is not None:
            with _peers():
                work.wait()

    @staticmethod
    def finish_p2p(work: Any) -> None:
        """`finish` for a point-to-point transfer (comm/p2p.py), waited for on a thread of its own."""
        with _peers(waits=False):
            work.wait()

    def all_to_all_(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int]
                    ) -> torch.Tensor:
        """1-D `t`: the first in_splits[0] elements to agent 0, the next to agent 1, ...; `out` gets
        out_splits[p] elements from each agent p, in agent order."""
        if self.world == 1:
            return out.copy_(t)
        self.bytes_reduced += t.numel() * t.element_size()
        self.collectives += 1
        with _peers():
            dist.all_to_all_single(out, t, out_splits, in_splits)
        return out

    def broadcast_(self, t: torch.Tensor, src: int) -> torch.Tensor:
        if self.world > 1:
            self.collectives += 1
            with _peers():
                dist.broadcast(t, src=src)
        return t

    def all_gather(self, t: torch.Tensor, side: bool = False) -> list[torch.Tensor]:
        """Every agent's `t` (same shape everywhere), in agent order. `side`: as in `send_bytes`."""
        if self.world == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.world)]
        if not side:
            self.collectives += 1
        with _peers(waits=not side):
            dist.all_gather(out, t.contiguous(), group=self.side if side else None)
        return out

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        """Every agent's `data` (any length), in agent order: two all_gathers of CPU tensors (gloo)."""
        if self.world == 1:
            return [data]
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [int(s.item()) for s in self.all_gather(size)]
        payload = torch.zeros(max(sizes), dtype=torch.uint8)
        if data:
            payload[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return [ctypes.string_at(t.data_ptr(), n) for t, n in zip(self.all_gather(payload), sizes, strict=True)]

    def isend(self, t: torch.Tensor, dst: int, tag: int) -> Any:
        """A point-to-point send to agent `dst`, started and returned at once (comm/p2p.py); CPU tensors, which
        gloo carries on every backend. Not counted in `collectives`: only its two agents take part."""
        with _peers(waits=False):
            return dist.isend(t, dst, tag=tag)

    def irecv(self, t: torch.Tensor, src: int, tag: int) -> Any:
        with _peers(waits=False):
            return dist.irecv(t, src, tag=tag)

    def send_(self, t: torch.Tensor, dst: int, tag: int) -> None:
        """A blocking point-to-point send, inside a sum that every agent takes part in (comm/islands.py):
        a wait here is a wait in a collective, which the beat file shows."""
        with _peers():
            dist.isend(t, dst, tag=tag).wait()

    def recv_(self, t: torch.Tensor, src: int, tag: int) -> torch.Tensor:
        with _peers():
            dist.irecv(t, src, tag=tag).wait()
        return t

    def barrier(self) -> None:
        if self.world > 1:
            self.collectives += 1
            with _peers():
                dist.barrier(**self.spec.barrier_kwargs())

    # Byte transfer for resize hand-overs: CPU tensors, which the group's gloo backend carries (also on
    # CUDA, where the group is "cpu:gloo,cuda:nccl").
    def send_bytes(self, data: bytes, dst: int, side: bool = False) -> None:
        """`side`: over the snapshot writer's own group (see `side`), from its thread."""
        group = self.side if side else None
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        with _peers(waits=not side):
            dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst, group=group)
            if payload.numel():
                dist.send(payload, dst, group=group)

    def recv_bytes(self, src: int, side: bool = False) -> bytes:
        group = self.side if side else None
        size = torch.zeros(1, dtype=torch.int64)
        with _peers(waits=not side):
            dist.recv(size, src, group=group)
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
            if payload.numel():
                dist.recv(payload, src, group=group)
        # Straight from the tensor's memory: numpy is not a dependency of the runtime.
        return ctypes.string_at(payload.data_ptr(), payload.numel())


class _Started:
    """A two-level all-reduce under way (comm/islands.py), waited for as a torch `Work` is."""

    def __init__(self, done: Future[torch.Tensor]) -> None:
        self._done = done

    def wait(self) -> bool:
        self._done.result()
        return True


_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}
