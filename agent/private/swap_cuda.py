"""Slots of a CUDA device: pinned host buffers, copies on a side stream, events for ordering.

Run on an H200 (tests/agent/test_cuda.py: swapping bitwise equal to an unbudgeted run, also
under a side stream). It follows the rules the CUDA caching allocator and stream semantics impose, with
the same interface as `elasticd.agent.private.swap.CpuMover`:

- The workers' kernels run on the device's current stream of their thread (the default stream unless the
  user sets one). A copy on the side stream first waits for that stream, so it reads what the outgoing
  worker wrote and writes a block only after earlier work on it is done.
- A block read or written by the side stream gets `record_stream(side)`: when the storage is freed
  (`resize_(0)`) the allocator will not hand the block to other work before the side-stream copy is done.
- `ready` makes the current stream of the thread that calls it wait on the restore's event, a GPU-side
  wait: the CPU does not block, and a prefetch issued while another worker computes really overlaps it.
  At a hand-over the listeners run in the outgoing worker's thread, so that is the outgoing worker's
  stream; the incoming worker may compute on another stream (`with torch.cuda.stream(s):`), and it is
  ordered after the copies by the hand-over event, recorded on the outgoing stream after `ready` and
  waited on in the incoming worker's own thread (`elasticd.agent.slicer.device`). Current streams are
  per thread: a wait made on the outgoing thread's stream alone would not order the incoming worker.
- Host buffers are pinned (page-locked) once per slot and reused: `non_blocking` copies from pageable
  memory would be synchronous, and pinning is slow. Both copies of a slot use the same side stream, so a
  buffer is never overwritten while a restore still reads it.
- The dedup checksum runs on the worker's stream and its result is read on the CPU, which waits for that
  stream: the price of deciding on the host whether to copy. It is only computed when no version counter
  proves the slot changed (see `elasticd.agent.private.registry`), and reading a slot at HBM speed is far cheaper than
  moving it over PCIe, so skipping unchanged slots pays off much more than on a CPU device.
"""

from __future__ import annotations

import torch

from elasticd.agent.private.swap import Slot, weights

_ROW = 512
_GROUP_ROWS = 64


def default_budget(device: torch.device) -> int:
    """Without --device-memory: 90% of the device for replicated plus private state. Activations, cuBLAS
    workspaces and the allocator's slack are not accounted, hence the margin; pass --device-memory for a
    tighter bound."""
    return int(torch.cuda.get_device_properties(device).total_memory * 0.9)


def cuda_checksum(data: torch.Tensor) -> int:
    """Row and column sums of the int64 view, each weighted by position (CUDA has no int64 `mv`), with no
    temporary near the size of the slot, and one device-to-host read."""
    n = data.numel()
    rows = n // (8 * _ROW)
    parts = [torch.tensor(n, dtype=torch.int64, device=data.device)]
    if rows:
        bulk = data[: rows * 8 * _ROW].view(torch.int64).view(rows, _ROW)
        parts.append((bulk.sum(dim=1) * weights(rows, 3, data.device)).sum())
        parts.append((column_sums(bulk) * weights(_ROW, 1, data.device)).sum())
    rest = data[rows * 8 * _ROW:]
    if rest.numel():
        parts.append((rest.to(torch.int64) * weights(rest.numel(), 5, data.device)).sum())
    h = 0
    for v in torch.stack(parts).tolist():
        h = ((h * 0x100000001B3) ^ v) & ((1 << 64) - 1)
    return h


def column_sums(bulk: torch.Tensor) -> torch.Tensor:
    """`bulk.sum(dim=0)` of a (rows, _ROW) int64 tensor, in two stages.

    One reduction of many rows to _ROW outputs makes torch's CUDA kernel split each column over many
    blocks through a global buffer: measured on an H200, 64 MiB of it for a 32 MiB slot, twice the state
    being swapped out. Groups of rows summed first leave enough outputs for one block each, and the small
    (groups, _ROW) result is summed after. Integer sums wrap, so the grouping does not change the result.
    """
    rows = bulk.shape[0]
    group = max(_GROUP_ROWS, rows // _ROW)  # at most _ROW groups: the intermediate stays <= 2 MiB
    whole = rows - rows % group
    sums = torch.zeros(_ROW, dtype=torch.int64, device=bulk.device)
    if whole:
        sums += bulk[:whole].view(whole // group, group, _ROW).sum(dim=1).sum(dim=0)
    if whole < rows:
        sums += bulk[whole:].sum(dim=0)
    return sums


class CudaMover:
    threaded = False  # copies are asynchronous on the side stream already; no copy thread needed
    pooled = False    # the caching allocator reuses freed blocks itself

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def _main(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def checksum(self, slot: Slot) -> int:
        # A prefetched slot evicted again before its worker ran may still be filling on the side stream.
        self.ready(slot)
        return cuda_checksum(slot.view())

    def save(self, slot: Slot) -> None:
        if slot.host is None or slot.host.numel() != slot.nbytes:
            slot.host = torch.empty(slot.nbytes, dtype=torch.uint8, pin_memory=True)
        dev = slot.view()
        self.stream.wait_stream(self._main())
        with torch.cuda.stream(self.stream):
            slot.host.copy_(dev, non_blocking=True)
        dev.record_stream(self.stream)
        slot.event = self.stream.record_event()

    def release(self, slot: Slot) -> None:
        slot.storage.resize_(0)

    def acquire(self, slot: Slot) -> bool:
        slot.storage.resize_(slot.nbytes)  # allocated on the current (worker) stream
        return False

    def load(self, slot: Slot) -> None:
        assert slot.host is not None
        dev = slot.view()
        # The block may have been freed by work on the worker stream that is still queued.
        self.stream.wait_stream(self._main())
        with torch.cuda.stream(self.stream):
            dev.copy_(slot.host, non_blocking=True)
        dev.record_stream(self.stream)
        slot.event = self.stream.record_event()

    def ready(self, slot: Slot) -> None:
        if slot.event is not None:
            self._main().wait_event(slot.event)
            slot.event = None

    def trim(self, nbytes: int) -> None:
        raise AssertionError("the CUDA mover keeps no pool")

    def adopt(self, slot: Slot) -> bool:
        return False  # device memory cannot take over a host buffer

    def close(self) -> None:
        self.stream.synchronize()
