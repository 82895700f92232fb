"""The arrays a function keeps in its own variables, as function_locals.py and tensor_containers.py carry them:
tensors autograd does not record and numpy arrays of numbers, copied to the host for a snapshot and back."""

from __future__ import annotations

import sys
import zlib
from typing import Any

import torch


def numpy_module() -> Any | None:
    return sys.modules.get("numpy")   # a job that never imported numpy holds no numpy array or generator


def is_array(value: Any) -> bool:
    """A tensor of the function's own data (a prefetched batch, a running sum, a data shard), not parameters
    or anything autograd records, which the model, optimizer and private state carry; or a numpy array of
    numbers (llm.c's loader keeps its shard's tokens as one, memory-mapped or not)."""
    if isinstance(value, torch.Tensor):
        return (not value.requires_grad and value.layout == torch.strided and not value.is_quantized
                and value.device.type != "meta")
    np = numpy_module()
    return np is not None and isinstance(value, np.ndarray) and value.dtype.kind in "biufc"


def nbytes(a: Any) -> int:
    return a.numel() * a.element_size() if isinstance(a, torch.Tensor) else int(a.nbytes)


def writes(a: Any) -> int | None:
    """torch's count of in-place writes; numpy keeps none (an array is told apart by its identity only)."""
    return a._version if isinstance(a, torch.Tensor) else None


def to_snapshot(a: Any) -> Any:
    """A copy a snapshot can hold: a tensor on the host, or a numpy array as its bytes, dtype and shape."""
    if isinstance(a, torch.Tensor):
        return a.detach().to("cpu", copy=True)
    np = numpy_module()
    assert np is not None
    flat = np.ascontiguousarray(a).reshape(-1)
    return {"numpy_bytes": torch.from_numpy(flat.view(np.uint8).copy()), "dtype": str(a.dtype),
            "shape": list(a.shape)}


def from_snapshot(saved: Any, device: torch.device | None) -> Any:
    """The array `to_snapshot` copied: a numpy array again, or the tensor on `device` (None: the host)."""
    if isinstance(saved, dict):
        np = numpy_module()
        assert np is not None, "a numpy array in a snapshot, with numpy gone"
        return np.frombuffer(saved["numpy_bytes"].numpy().tobytes(), dtype=saved["dtype"]).reshape(saved["shape"]).copy()
    return saved.to(device) if device is not None else saved


# Elements of a big array read for its fingerprint, evenly spaced: enough to tell one data shard from another,
# few enough that a memory-mapped one is read in a few thousand pages, not whole.
SAMPLES = 1 << 12


def fingerprint(a: Any, whole_up_to: int) -> tuple[Any, ...] | None:
    """Shape, dtype and a CRC of the bytes, read where the array lives: all of them up to `whole_up_to` bytes,
    beyond that 4 096 evenly spaced elements; None for one whose bytes cannot be read that way."""
    try:
        if not isinstance(a, torch.Tensor):
            flat = a.reshape(-1)
            if nbytes(a) > whole_up_to and flat.size > SAMPLES:
                flat = flat[(numpy_module().linspace(0, flat.size - 1, SAMPLES)).astype("int64")]
            return tuple(a.shape), str(a.dtype), zlib.crc32(flat.tobytes())
        flat = a.detach().reshape(-1)
        if nbytes(a) > whole_up_to and flat.numel() > SAMPLES:
            flat = flat[torch.linspace(0, flat.numel() - 1, SAMPLES, device=flat.device).long()]
        host = flat.to("cpu").contiguous()
        return tuple(a.shape), str(a.dtype), zlib.crc32(host.view(torch.uint8).numpy().tobytes())
    except (RuntimeError, TypeError, ValueError):
        return None
