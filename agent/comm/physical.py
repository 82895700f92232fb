"""The physical process group: the M agents of a job (gloo on CPU, NCCL on CUDA).

Every physical collective of an agent goes through this class, so a world of one agent costs
nothing and the logical layer never special-cases it.
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed.distributed_c10d as dist  # unpatched: flushes run in worker threads, where torch.distributed.* is logical (agent/compat/torch_dist.py)

log = logging.getLogger(__name__)


class PhysicalGroup:
    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank = rank
        self.world = world
        self.device = device
        self.bytes_reduced = 0  # accounting for benchmarks and tests
        self._gloo: Any = None

    @classmethod
    def connect(cls, rank: int, world: int, device: torch.device, master_addr: str, master_port: int,
                timeout_s: float = 600.0) -> PhysicalGroup:
        if world > 1:
            if master_addr in ("127.0.0.1", "localhost", "::1"):
                # gloo otherwise resolves the hostname, which in containers often points nowhere useful.
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            backend = "nccl" if device.type == "cuda" else "gloo"
            dist.init_process_group(
                backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank, world_size=world,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
            log.info("physical group up: rank %d of %d (%s)", rank, world, backend)
        return cls(rank, world, device)

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce_(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self.world > 1:
            self.bytes_reduced += t.numel() * t.element_size()
            dist.all_reduce(t, op=_OPS[op])
        return t

    def all_to_all_(self, out: torch.Tensor, t: torch.Tensor, out_splits: list[int], in_splits: list[int]
                    ) -> torch.Tensor:
        """1-D `t`: the first in_splits[0] elements to agent 0, the next to agent 1, ...; `out` gets
        out_splits[p] elements from each agent p, in agent order."""
        if self.world == 1:
            return out.copy_(t)
        self.bytes_reduced += t.numel() * t.element_size()
        dist.all_to_all_single(out, t, out_splits, in_splits)
        return out

    def broadcast_(self, t: torch.Tensor, src: int) -> torch.Tensor:
        if self.world > 1:
            dist.broadcast(t, src=src)
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every agent's `t` (same shape everywhere), in agent order."""
        if self.world == 1:
            return [t]
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t.contiguous())
        return out

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    # Byte transfer for resize hand-overs. NCCL moves device tensors only, so on CUDA these go over a
    # gloo side group (created lazily: only a resize needs it).
    def _cpu_group(self) -> Any:
        if self.device.type != "cuda":
            return None
        if self._gloo is None:
            self._gloo = dist.new_group(backend="gloo")
        return self._gloo

    def send_bytes(self, data: bytes, dst: int) -> None:
        group = self._cpu_group()
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst, group=group)
        dist.send(payload, dst, group=group)

    def recv_bytes(self, src: int) -> bytes:
        group = self._cpu_group()
        size = torch.zeros(1, dtype=torch.int64)
        dist.recv(size, src, group=group)
        payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.recv(payload, src, group=group)
        # Straight from the tensor's memory: numpy is not a dependency of the runtime.
        return ctypes.string_at(payload.data_ptr(), payload.numel())


_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}
