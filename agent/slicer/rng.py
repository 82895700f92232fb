"""Per-worker random-number streams.

Each logical worker must draw from its own streams, exactly as it would in its own process: the torch
CPU generator, the CUDA generator of its device, Python's `random` and numpy's global state are
process-wide, so the agent saves the outgoing worker's states and restores the incoming worker's at
every hand-off. A fresh worker starts from the states the agent process had at start-up (what a
freshly started DDP process would have).
"""

from __future__ import annotations

import ctypes
import random
import struct
import sys
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(slots=True)
class RngState:
    torch_cpu: torch.Tensor
    python: Any
    numpy: Any | None = None
    cuda: torch.Tensor | None = None
    numpy_key: bytes | None = None  # numpy's raw MT19937 bytes when `numpy` was taken (see _numpy_key)
    python_key: tuple[bytes, Any] | None = None   # the same for `random` (see _python_key)

    def to_dict(self) -> dict[str, Any]:
        """Plain containers for snapshots (resize, checkpoints)."""
        return {"torch_cpu": self.torch_cpu.clone(), "python": self.python, "numpy": self.numpy,
                "cuda": None if self.cuda is None else self.cuda.clone()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RngState:
        return cls(torch_cpu=d["torch_cpu"], python=d["python"], numpy=d.get("numpy"), cuda=d.get("cuda"))


_np_random: Any | None = None


def _numpy_random() -> Any | None:
    # Only touch numpy if someone imported it; importing it here would cost every switch nothing but
    # would make the agent pay an import the user never asked for. Once found it is kept: a lookup in
    # sys.modules right after a worker's compute (cold caches) cost ~2.6 us of every hand-over.
    global _np_random
    if _np_random is None:
        np = sys.modules.get("numpy")
        _np_random = None if np is None else np.random
    return _np_random


def _numpy_key(np_random: Any) -> bytes | None:
    """The global generator's raw MT19937 state (2500 bytes, ~0.1 us) where numpy exposes it.

    `get_state`/`set_state` cost ~100 us each and most jobs never draw from numpy, so a hand-over
    skips them when these bytes show the state did not move. The bytes leave out the cached Gaussian
    of `randn`, which is why a skip also requires that none is cached (`has_gauss == 0`): making one
    needs fresh draws, which would change the bytes.
    """
    raw = _np_state[1]
    if raw is None:
        try:
            bit_generator = np_random.mtrand._rand._bit_generator
            # Looked up once: the global generator keeps its bit generator for life (`seed`, `set_state` and
            # unpickling write into it), and the state lives inside that object, so its address holds while
            # we keep a reference. The lookups and `.ctypes` cost ~10 us of a hand-over (caches cold).
            raw = _raw(bit_generator.ctypes.state_address)
        except (AttributeError, TypeError):
            return None
        _np_state[:] = [bit_generator, raw]
    return raw.raw


def _raw(address: int) -> Any:
    """The 2500 bytes of an MT19937 state at `address`, as a ctypes array read in place: `.raw` copies
    them in one C call, where `ctypes.string_at` goes through Python code and a foreign-function call."""
    return (ctypes.c_char * 2500).from_address(address)


_np_state: list[Any] = [None, None]   # numpy's global bit generator and its MT19937 state (see _raw)


def _python_key_offset() -> int | None:
    """Where CPython keeps a `random.Random`'s Mersenne Twister (`int index; uint32_t state[624]` right
    after the object header), checked against `getstate()` once; None where the layout differs."""
    probe = random.Random(20261122)
    probe.random()
    offset = object.__basicsize__
    try:
        index, *words = struct.unpack("<i624I", ctypes.string_at(id(probe) + offset, 2500))
    except (ValueError, OSError, struct.error):
        return None
    state = probe.getstate()[1]
    return offset if (index == state[-1] and tuple(words) == state[:-1]) else None


_PY_OFFSET = _python_key_offset() if sys.implementation.name == "cpython" else None
_py_state: list[Any] = [None, None]   # `random`'s module-level generator and its state (see _raw)


def _python_key() -> tuple[bytes, Any] | None:
    """`random`'s raw generator bytes (~0.1 us) and its cached Gaussian.

    `random.getstate()` builds a 625-int tuple (~27 us) and `setstate` ~7 us; with a few hand-overs per
    worker per step that was ~2% of a small step, for a stream most jobs never draw from. `gauss()` can
    consume its cached value without touching the generator, hence the second half of the key.
    """
    if _PY_OFFSET is None:
        return None
    inst = random._inst  # type: ignore[attr-defined]  # the module-level functions' generator
    if inst is not _py_state[0]:
        _py_state[:] = [inst, _raw(id(inst) + _PY_OFFSET)]   # held, so the address stays its
    return _py_state[1].raw, inst.gauss_next


def _no_cached_gauss(numpy_state: Any) -> bool:
    return numpy_state is not None and numpy_state[3] == 0


_torch_get = torch.default_generator.get_state
_torch_set = torch.default_generator.set_state
_byte_arrays: dict[int, Any] = {}


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two contiguous CPU byte tensors (generator states) hold the same bytes. Read in place through ctypes:
    `torch.equal` goes through the dispatcher, ~8 us of a hand-over where caches are cold after compute."""
    n = a.numel()
    if n != b.numel():
        return False
    array = _byte_arrays.get(n)
    if array is None:
        array = _byte_arrays[n] = ctypes.c_char * n
    return bool(array.from_address(a.data_ptr()).raw == array.from_address(b.data_ptr()).raw)


def capture(cuda_device: torch.device | None = None, prev: RngState | None = None) -> RngState:
    """The live streams. `prev`: what this worker's streams were when it got the baton; returned itself
    when no stream moved since (most hand-overs of most jobs), which lets `restore` skip everything."""
    np_random = _numpy_random()
    numpy_state, key = None, None
    np_unmoved = np_random is None and (prev is None or prev.numpy is None)
    if np_random is not None:
        key = _numpy_key(np_random)
        np_unmoved = (prev is not None and key is not None and key == prev.numpy_key
                      and _no_cached_gauss(prev.numpy))
        numpy_state = prev.numpy if np_unmoved and prev is not None else np_random.get_state()
    py_key = _python_key()
    py_unmoved = prev is not None and py_key is not None and py_key == prev.python_key
    torch_cpu = _torch_get()
    cuda = torch.cuda.get_rng_state(cuda_device) if cuda_device is not None else None
    if (prev is not None and np_unmoved and py_unmoved and _same_bytes(torch_cpu, prev.torch_cpu)
            and (cuda is None or (prev.cuda is not None and torch.equal(cuda, prev.cuda)))):
        return prev
    return RngState(
        torch_cpu=torch_cpu,
        python=prev.python if py_unmoved and prev is not None else random.getstate(),
        numpy=numpy_state,
        cuda=cuda,
        numpy_key=key,
        python_key=py_key,
    )


def restore(state: RngState, cuda_device: torch.device | None = None, live: RngState | None = None) -> None:
    """Make `state` the live streams. `live`: the streams just captured from the outgoing worker."""
    if state is live:
        return   # the same streams, unmoved since both workers last had them (capture returned them)
    _torch_set(state.torch_cpu)
    if not (live is not None and state.python_key is not None and live.python_key == state.python_key):
        if state.python_key is not None and _py_state[0] is random._inst:  # type: ignore[attr-defined]
            # The generator's bytes written in place (~0.2 us, setstate ~7 us) and its cached Gaussian:
            # the whole state of a `random.Random`, as _python_key_offset checked.
            ctypes.memmove(_py_state[1], state.python_key[0], len(state.python_key[0]))
            random._inst.gauss_next = state.python_key[1]  # type: ignore[attr-defined]
        else:
            random.setstate(state.python)
    np_random = _numpy_random()
    if np_random is not None and state.numpy is not None:
        no_gauss = live is not None and _no_cached_gauss(live.numpy) and _no_cached_gauss(state.numpy)
        if not (no_gauss and state.numpy_key is not None and live.numpy_key == state.numpy_key):
            if no_gauss and state.numpy_key is not None and _np_state[1] is not None:
                # Workers whose streams differ (each seeded its own, or torchrun mode's fresh ones): the
                # MT19937 bytes written in place, ~0.2 us where set_state costs ~85 us at every hand-over.
                # Neither side holds a cached Gaussian, so those bytes are all that differs.
                ctypes.memmove(_np_state[1], state.numpy_key, len(state.numpy_key))
            else:
                np_random.set_state(state.numpy)
    if cuda_device is not None and state.cuda is not None:
        torch.cuda.set_rng_state(state.cuda, cuda_device)


# -- streams of a worker's own --------------------------------------------------------------------------
# torch's seed of its CPU generator in a process that never seeded it, in torch versions that use a constant
# (this one seeds from the OS, as Python does `random` and numpy its global generator).
TORCH_CONSTANT_SEED = 67280421310721


def _numpy_fingerprint() -> tuple[bytes, Any] | None:
    np_random = _numpy_random()
    if np_random is None:
        return None
    state = np_random.get_state()
    return state[1].tobytes() + state[2].to_bytes(4, "little", signed=True), state[3:]


# The process's streams before the user's code could seed them, taken by mark_start.
_START: tuple[int, Any, tuple[bytes, Any] | None] | None = None


def mark_start() -> None:
    """Remember the process's streams as they are now, before any user code runs (idempotent).

    Called as an agent process starts, and by `import elasticd` where torch is already imported (the
    script's own process, for a decorated function called directly). Where it was never called before
    the user's code ran, nothing counts as unseeded: workers share the process's streams.
    """
    global _START
    if _START is None:
        _START = (torch.initial_seed(), random.getstate(), _numpy_fingerprint())


@dataclass(frozen=True, slots=True)
class Unseeded:
    """Which of the process's global streams no user code has seeded (nor drawn from, for `random` and
    numpy, whose seeding leaves no trace but their state) since the agent started."""

    torch: bool
    python: bool
    numpy: bool

    def __bool__(self) -> bool:
        return self.torch or self.python or self.numpy


def unseeded() -> Unseeded:
    if _START is None:
        return Unseeded(torch=False, python=False, numpy=False)
    return Unseeded(torch=torch.initial_seed() == _START[0] != TORCH_CONSTANT_SEED,
                    python=random.getstate() == _START[1],
                    numpy=_START[2] is not None and _numpy_fingerprint() == _START[2])


def seed_from_os(which: Unseeded) -> None:
    """Seed the live streams in `which` as a fresh process finds them: from the OS."""
    if which.python:
        random.seed()
    np_random = _numpy_random()
    if which.numpy and np_random is not None:
        np_random.seed()
    if which.torch:
        torch.seed()   # CPU and every CUDA device, as this torch's fresh process


def own_streams(base: RngState, which: Unseeded, cuda_device: torch.device | None = None) -> RngState:
    """`base` with the streams in `which` seeded from the OS: what a worker starts with where a DDP process
    would start with its own numbers. The live streams are `base` again afterwards."""
    seed_from_os(which)
    mine = capture(cuda_device)
    restore(base, cuda_device)
    return mine
