"""What the scheduler's state machine asks its I/O loop to do."""

from __future__ import annotations

from dataclasses import dataclass

from elasticd import protocol as p


@dataclass(slots=True)
class SendToNode:
    """Action: deliver `msg` to node `node_id` (dropped by the server if the node is not connected)."""

    node_id: str
    msg: p.Message
