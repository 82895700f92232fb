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
