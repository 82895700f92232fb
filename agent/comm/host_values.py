"""A flush's few numbers between the host and its device, without making the host wait for queued work.

Each flush moves a handful of values each way: which parameters have gradients and the agents'
step-boundary ballot go to the device; the summed flags and ballot come back. On a GPU,
`torch.tensor(values, device=...)` copies from pageable host memory, which makes the host wait until the
stream has run everything queued before it (the whole backward), and every `.tolist()` of a device tensor
waits for the stream too. So values go to the device from pinned memory without a wait, and what a flush
reads back is read in one device-to-host copy: one wait per flush, which it needs anyway for the values.
On the CPU both are plain copies.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(values: Sequence[float | int | bool], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    # The caching host allocator keeps a pinned block until the copy queued from it has run.
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


def flags(used: Sequence[bool], like: torch.Tensor) -> torch.Tensor:
    """One flag per parameter, 1 where it has a gradient, as a tensor of `like`'s dtype and device; all set,
    the usual case, costs no copy at all."""
    if all(used):
        return like.new_ones(len(used))
    return to_device(used, like.dtype, like.device)


def read(tensors: Sequence[torch.Tensor]) -> list[list[float]]:
    """The values of small tensors of one device, in one read: exact for the small integers flags and ballots
    hold, whatever their dtype."""
    if len(tensors) <= 1:
        return [t.tolist() for t in tensors]
    values = torch.cat([t.detach().reshape(-1).to(torch.float64) for t in tensors]).tolist()
    out, at = [], 0
    for t in tensors:
        out.append(values[at:at + t.numel()])
        at += t.numel()
    return out
