"""What devices this node offers to the island."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from elasticd import protocol as p

log = logging.getLogger(__name__)

_PROBE = (
    "import torch\n"
    "n = torch.cuda.device_count() if torch.cuda.is_available() else 0\n"
    "print(n)\n"
    "for i in range(n): print(torch.cuda.get_device_name(i))\n"
)


def cpu_devices(count: int) -> list[p.DeviceInfo]:
    return [p.DeviceInfo(device_id=f"cpu:{i}", type="cpu", index=i, name="cpu") for i in range(count)]


def cuda_devices(count: int) -> list[p.DeviceInfo]:
    """`count` CUDA devices by index, unprobed: `elasticd run`'s node serves the GPUs the run checked itself,
    and under the gloo test switch several of its agents share one (agent_config.cuda_ordinal)."""
    return [p.DeviceInfo(device_id=f"cuda:{i}", type="cuda", index=i, name="") for i in range(count)]


def discover(cpu: int | None = None, timeout_s: float = 120.0) -> list[p.DeviceInfo]:
    """`cpu` CPU devices if given; else every CUDA device torch sees; else one CPU device.

    CUDA is probed in a child process so the daemon itself never imports torch or holds a CUDA
    context (the agents need the devices' memory, not the daemon).
    """
    if cpu is not None:
        return cpu_devices(cpu)
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=timeout_s,
                           env={**os.environ, "PYTHONWARNINGS": "ignore"})
        lines = r.stdout.strip().splitlines()
        n = int(lines[0]) if r.returncode == 0 and lines else 0
    except (subprocess.TimeoutExpired, OSError, ValueError) as e:
        log.warning("CUDA probe failed (%s); offering one CPU device", e)
        n, lines = 0, []
    if n == 0:
        return cpu_devices(1)
    return [p.DeviceInfo(device_id=f"cuda:{i}", type="cuda", index=i, name=lines[1 + i] if len(lines) > 1 + i else "")
            for i in range(n)]


MAX_SPEED = 1e6


def parse_speeds(spec: str) -> tuple[float | None, dict[int, float]]:
    """`--device-speed SPEC`: one relative speed for every device ("0.5"), or per device index
    ("0=1.0,1=0.5"; devices not named keep 1.0). Returns (for all, by index).

    Raises:
        ValueError: naming what is wrong with SPEC.
    """
    spec = spec.strip()
    if not spec:
        raise ValueError("--device-speed is empty: give one speed (0.5) or INDEX=SPEED pairs (0=1.0,1=0.5)")
    if "=" not in spec:
        return _speed(spec, "--device-speed"), {}
    by_index: dict[int, float] = {}
    for item in spec.split(","):
        idx, sep, val = item.strip().partition("=")
        if not sep or not idx.strip().isdigit():
            raise ValueError(f"--device-speed: {item.strip()!r} is not INDEX=SPEED (e.g. 0=1.0,1=0.5)")
        i = int(idx)
        if i in by_index:
            raise ValueError(f"--device-speed names device {i} twice")
        by_index[i] = _speed(val, f"--device-speed for device {i}")
    return None, by_index


def with_speeds(devices: list[p.DeviceInfo], spec: str | None) -> list[p.DeviceInfo]:
    """`devices` with the speeds `spec` declares (see `parse_speeds`); None: as they are (undeclared).

    Raises:
        ValueError: a bad SPEC, or one naming a device index this node does not have.
    """
    if spec is None:
        return devices
    every, by_index = parse_speeds(spec)
    unknown = sorted(set(by_index) - {d.index for d in devices})
    if unknown:
        have = ",".join(str(d.index) for d in devices)
        raise ValueError(f"--device-speed names device(s) {unknown}; this node has devices {have}")
    return [p.DeviceInfo(device_id=d.device_id, type=d.type, index=d.index, name=d.name,
                         speed=every if every is not None else by_index.get(d.index, 1.0)) for d in devices]


def _speed(text: str, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise ValueError(f"{what}: {text.strip()!r} is not a number") from None
    if not 0 < v <= MAX_SPEED:   # also refuses nan and inf
        raise ValueError(f"{what} must be a relative speed in (0, {MAX_SPEED:g}] (1.0 = reference), got {text.strip()}")
    return v
