"""elasticd: N logical data-parallel workers time-sliced on M <= N devices, resizable live.

The user surface is the decorator; everything else is the control plane. The decorator is
re-exported lazily so that control-plane commands (`elasticd status`) do not import torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["elastic"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "elastic":
        from elasticd.agent.decorator import elastic

        return elastic
    raise AttributeError(f"module 'elasticd' has no attribute {name!r}")
