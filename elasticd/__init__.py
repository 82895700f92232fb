"""elasticd: N logical data-parallel workers time-sliced on M <= N devices, resizable live.

The user surface is the decorator; everything else is the control plane. The decorator is
re-exported lazily so that control-plane commands (`elasticd status`) do not import torch.
"""

from __future__ import annotations

import sys
from typing import Any

if "torch" in sys.modules:
    # The script's random streams before it can seed them: a worker gets streams of its own only from
    # streams nobody seeded (agent/slicer/rng.py). Without torch imported nothing could have, and the
    # control-plane commands must not pay for importing it.
    from elasticd.agent.slicer.rng import mark_start

    mark_start()

__all__ = ["elastic"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "elastic":
        from elasticd.agent.decorator import elastic

        return elastic
    raise AttributeError(f"module 'elasticd' has no attribute {name!r}")
