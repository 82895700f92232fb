"""The physical process group: the M agents of a job (gloo on CPU, NCCL on CUDA).

Every physical collective of an agent goes through this class, so a world of one agent costs
nothing and the logical layer never special-cases it.
"""

from __future__ import annotations

import datetime
import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class PhysicalGroup:
    def __init__(self, rank: int, world: int, device: torch.device) -> None:
        self.rank = rank
        self.world = world
        self.device = device
        self.bytes_reduced = 0  # accounting for benchmarks and tests

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


_OPS = {
    "sum": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
    "product": dist.ReduceOp.PRODUCT,
}
