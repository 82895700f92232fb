"""Speed-aware placement, pure policy: the cost model, the placer, the re-layout gate, a simulator.

No I/O, no sockets, no torch: the scheduler feeds measurements in and carries decisions out.
"""

from __future__ import annotations

from elasticd.placement.cost import CostModel, DeviceKey, device_key
from elasticd.placement.hysteresis import RelayoutGate
from elasticd.placement.placer import Placement, block_sizes, choose, uniform_sizes

__all__ = ["CostModel", "DeviceKey", "Placement", "RelayoutGate", "block_sizes", "choose", "device_key",
           "uniform_sizes"]
