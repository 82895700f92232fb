"""Who may ask the scheduler for what: a pure decision from the peer's principal and the message.

The transport tells us who a peer is (the Z85 key CURVE authenticated, looked up on the allow-list,
or "local" for the IPC/inproc socket, which only this user can open); this module decides whether
that principal may send this message. No sockets here, so every rule is unit-testable.

    role     may send
    node     node_hello / node_status / node_bye / logs_reply for its own node id only; plus what a
             client may (the CLI on that node relays submit/status/stop/scale/logs through it), the
             logs of any job, and a drain of its own node (a daemon SIGTERMed with a grace period)
    client   submit (its jobs run as the user its key maps to; only an admin names another), status; logs, events, stop and scale of the jobs it submitted (`events` without a
             job: the server shows it its own jobs' events and the nodes')
    admin    everything: stop/scale anyone's job, shutdown, and any op not listed here (drain, ...)
    local    as admin, and node messages for any node id (the embedded scheduler's own daemon)

An op this table does not name is admin-only: a new request type is closed until someone opens it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

from elasticd import keys
from elasticd import protocol as p

LOCAL_OWNER = "local"

_NODE_MODULE = p.NodeHello.__module__   # elasticd.protocol.nodes: everything a node and the scheduler say


def _node_op(msg: p.Message) -> bool:
    """A node's own message: any type of protocol/nodes.py (so one added there later is bound to its node
    too, not opened to every key), and the node's answer to a forwarded `logs` request."""
    return type(msg).__module__ == _NODE_MODULE or isinstance(msg, p.LogsReply)

_ANYONE = (p.Submit, p.Status, p.Logs, p.Events)
_OWNER_OR_ADMIN = (p.Stop, p.Scale)


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated peer. `owner` is what jobs it submits are recorded under (its Z85 key)."""

    owner: str
    role: str
    name: str = ""
    node_id: str | None = None
    local: bool = False
    run_as: str = ""   # the Unix user its jobs run as ("": each node's default; elasticd/daemon/job_user.py)

    @property
    def admin(self) -> bool:
        return self.local or self.role == keys.ADMIN

    def describe(self) -> str:
        return "a local client" if self.local else f"key {self.name!r} ({self.role})"


LOCAL = Principal(owner=LOCAL_OWNER, role=keys.ADMIN, name="local", local=True)


def principal_of(key: str, grant: keys.KeyGrant) -> Principal:
    return Principal(owner=key, role=grant.role, name=grant.name, node_id=grant.node_id, run_as=grant.run_as or "")


class Grants(Protocol):   # transport.AllowList
    def grant(self, z85_key: str) -> keys.KeyGrant | None: ...


def peer(user_id: str | None, allow: Grants | None, *, local: bool) -> Principal | None:
    """Who sent a frame: LOCAL on an ipc/inproc socket (only this user can open it); on TCP, the grant of
    the key CURVE authenticated, or None when that key left the allow-list after the handshake."""
    if local:
        return LOCAL
    grant = allow.grant(user_id) if (allow is not None and user_id) else None
    return principal_of(user_id, grant) if grant is not None and user_id else None


class Refusals:
    """Logs each refusal once per (key, op, the id it named): a node or island retrying its hello every
    second must not flood the log, and an operator must still see the first one. Bounded: past `limit`
    distinct refusals, the rest go to the debug log."""

    def __init__(self, logger: logging.Logger, limit: int = 4096) -> None:
        self._log, self._limit = logger, limit
        self._seen: set[tuple[str, str, str]] = set()

    def __call__(self, who: Principal, msg: p.Message, why: str, named: str = "") -> None:
        key = (who.owner, msg.op, named)
        if key in self._seen or len(self._seen) >= self._limit:
            self._log.debug("%s from %s refused again: %s", msg.op, who.describe(), why)
            return
        self._seen.add(key)
        self._log.warning("refused %s from %s: %s", msg.op, who.describe(), why)


def run_as(who: Principal, msg: p.Submit) -> str:
    """The user a job `who` submits runs as: the one an admin named, else the one its key maps to
    (`check` refused any other choice)."""
    return msg.run_as or who.run_as


def sees_all_jobs(who: Principal) -> bool:
    """Whether an island-wide read (`events` without a job) shows `who` every job, or only its own."""
    return who.admin or who.role == keys.NODE


def redacted(error: dict[str, p.Scalar] | None) -> dict[str, p.Scalar] | None:
    """Another owner's job's error as a client sees it: what failed where, not its message or traceback
    (user text: paths, data, secrets a script put in an exception)."""
    if error is None:
        return None
    kept = {k: v for k, v in error.items() if k in ("cause", "rank", "node", "exitcode")}
    return {**kept, "message": "hidden: the error of another owner's job (its owner and admins see it)"}


def check(who: Principal, msg: p.Message, job_owner: str | None = None) -> str | None:
    """Why `who` may not send `msg` (None: it may). `job_owner` is the owner of the job `msg` names,
    when it names one that exists."""
    if who.role == keys.ISLAND:   # an island scheduler's key speaks to a federation front, not to a scheduler
        return f"{who.describe()} may not send {msg.op}: an island key is for the federation front only"
    if _node_op(msg):
        node_id = getattr(msg, "node_id", who.node_id)
        if who.local:
            return None
        if who.role != keys.NODE:
            return (f"{who.describe()} may not send {msg.op}: only a node key may, and only for its own node "
                    "(allow one with `elasticd keygen --allow KEY --role node --node-id ID`)")
        if node_id != who.node_id:
            return f"{who.describe()} is bound to node {who.node_id!r}; it may not speak for node {node_id!r}"
        return None
    if who.admin:
        return None
    if isinstance(msg, p.Drain) and who.role == keys.NODE:
        if msg.node_id == who.node_id:
            return None   # elasticd.daemon.grace: a node about to go drains itself
        return f"{who.describe()} is bound to node {who.node_id!r}; it may not drain node {msg.node_id!r}"
    if isinstance(msg, p.Submit) and msg.run_as and msg.run_as != who.run_as:
        return (f"{who.describe()} may not choose the user its job runs as (--run-as): its jobs run as "
                + (repr(who.run_as) if who.run_as else "each node's default user")
                + " (an admin maps a key to a user with `elasticd keygen --allow KEY --run-as USER`)")
    if isinstance(msg, _ANYONE):
        # A node already hosts jobs' agents and their logs, and `elasticd logs` on it gathers a job's logs
        # from every node: it may read any job's. A client key reads its own jobs' only.
        # A job no longer in the table (purged) is nobody's: its logs, still on a node, are an admin's to read.
        if isinstance(msg, p.Logs) and who.role == keys.CLIENT and job_owner != who.owner:
            return f"{who.describe()} may read only the logs of its own jobs" + \
                (f" (no job {msg.job_id} in the table)" if job_owner is None else "")
        if isinstance(msg, p.Events) and who.role == keys.CLIENT and job_owner is not None and job_owner != who.owner:
            return f"{who.describe()} may read only the events of its own jobs"
        return None
    if isinstance(msg, _OWNER_OR_ADMIN):
        if job_owner is None or job_owner == who.owner:
            return None   # an unknown job gets its own `unknown_job` error further on
        return f"{who.describe()} may {msg.op.replace('_job', '')} only its own jobs (an admin key may any)"
    return f"{who.describe()} may not send {msg.op}: it needs an admin key"
