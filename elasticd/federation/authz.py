"""Who may tell the federation front what: a pure decision from the peer's principal and the message.

    role     may send
    island   island_hello / island_status / island_bye for its own island id only (its key is bound to
             it: `elasticd keygen --allow KEY --role island --island-id ID` on the front's state dir)
    client   islands (the table); submit a job spanning islands, read the table of such jobs, and stop
             those it submitted and read their events (the front checks the owner)
    admin    everything
    local    as admin (the front's own ipc socket, which only its user can open)

A node key has nothing to say to a front. An op this table does not name is admin-only.
"""

from __future__ import annotations

from elasticd import keys
from elasticd import protocol as p
from elasticd.scheduler.authz import Principal

_ISLAND_OPS = (p.IslandHello, p.IslandStatus, p.IslandBye)
_CLIENT_OPS = (p.SubmitSpanning, p.ListSpans, p.Stop, p.Events)


def check(who: Principal, msg: p.Message) -> str | None:
    """Why `who` may not send `msg` to the front (None: it may)."""
    if who.local:
        return None
    if isinstance(msg, _ISLAND_OPS):
        if who.role != keys.ISLAND:
            return (f"{who.describe()} may not send {msg.op}: only an island key may, and only for its own "
                    "island (allow one with `elasticd keygen --allow KEY --role island --island-id ID`)")
        if msg.island_id != who.node_id:
            return f"{who.describe()} is bound to island {who.node_id!r}; it may not speak for {msg.island_id!r}"
        return None
    if who.admin:
        return None
    if isinstance(msg, p.ListIslands) and who.role in (keys.CLIENT, keys.ISLAND):
        return None
    if isinstance(msg, _CLIENT_OPS) and who.role == keys.CLIENT:
        return None
    return f"{who.describe()} may not send {msg.op} to a federation front"
