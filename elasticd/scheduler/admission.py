"""What the scheduler admits and keeps: capacity checks, job quotas, retention of ended jobs, and the
paging of job lists. Pure functions over the job and node tables; the server loop calls them.

Without these, the job table only grew: 4000 jobs made the `status` reply exceed the frame limit for
good, and a request that no island could ever place queued forever.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elasticd import protocol as p
from elasticd.protocol.wire import encoded_size
from elasticd.scheduler.jobs import Job
from elasticd.scheduler.state import Node, SchedulerError

if TYPE_CHECKING:
    from elasticd.scheduler.authz import Principal

PAGE_BYTES = 512 * 1024        # one status page, well under the 1 MiB frame limit with the node table


@dataclass(slots=True)
class Limits:
    job_retention_s: float | None = 7 * 86400   # ended jobs are purged this long after they ended
    max_ended: int = 5000                        # and beyond this many, oldest first, whatever their age
    max_jobs: int = 10000                        # queued + running jobs on the island
    max_jobs_per_owner: int = 1000               # queued + running jobs of one key (admins included)


KEY_RATE = 100.0      # requests a second one client or admin key may send, sustained
KEY_BURST = 400.0     # and at once (a `status --watch` of a few panes, a script submitting a sweep)
_MAX_KEYS = 4096      # keys remembered; the least recently seen go first


class KeyBudget:
    """A token bucket per key: nodes' heartbeats share the scheduler's loop (and its TCP socket) with
    clients, so no one key may keep it busy. Keys that are full again are forgotten."""

    def __init__(self, rate: float = KEY_RATE, burst: float = KEY_BURST) -> None:
        self.rate, self.burst = rate, burst
        self._tokens: dict[str, tuple[float, float]] = {}   # key -> (tokens, when)

    def busy(self, who: Principal, exempt: str, now: float) -> str | None:
        """Why `who`'s request is refused for its rate (None: it is served). `exempt`: the role whose
        reports the budget protects (nodes on a scheduler, islands on a federation front), never limited,
        nor is the local socket."""
        if who.local or who.role == exempt or self.take(who.owner, now):
            return None
        return f"busy: {who.describe()} sent more than {KEY_RATE:.0f} requests a second; slow down"

    def take(self, key: str, now: float) -> bool:
        tokens, when = self._tokens.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - when) * self.rate)
        ok = tokens >= 1.0
        self._tokens[key] = (tokens - 1.0 if ok else tokens, now)   # re-inserted: the newest in the dict
        if len(self._tokens) > _MAX_KEYS:
            del self._tokens[next(iter(self._tokens))]
        return ok


def capacity(nodes: Iterable[Node]) -> tuple[int, int]:
    """(devices, nodes) the island offers at best: every device of every live node."""
    live = [nd for nd in nodes if nd.alive and nd.known]
    return sum(len(nd.devices) for nd in live), len(live)


def check_fits(nodes: Iterable[Node], devices: int, what: str) -> None:
    """Refuse a request for more devices than the island has, as Slurm does ("Requested node
    configuration is not available"). An island with no live node yet admits anything: its nodes
    may still be on their way.

    Raises:
        SchedulerError: `bad_request` naming the island's size.
    """
    total, count = capacity(nodes)
    if count and devices > total:
        raise SchedulerError(p.BAD_REQUEST, f"{what} {devices} devices, but the island has {total} on "
                                            f"{count} node(s): it could never run")


def check_quota(jobs: Iterable[Job], owner: str, limits: Limits) -> None:
    """Raises:
        SchedulerError: `quota` when the island or this owner has too many queued or running jobs.
    """
    live = [j for j in jobs if not j.state.terminal]
    if len(live) >= limits.max_jobs:
        raise SchedulerError(p.QUOTA, f"the island already holds {len(live)} queued or running jobs "
                                      f"(--max-jobs {limits.max_jobs}); wait for some to end")
    mine = sum(1 for j in live if j.spec.owner == owner)
    if mine >= limits.max_jobs_per_owner:
        raise SchedulerError(p.QUOTA, f"this key already has {mine} queued or running jobs "
                                      f"(--max-jobs-per-owner {limits.max_jobs_per_owner}); wait for some to end")


def expired(jobs: Iterable[Job], now: float, limits: Limits) -> list[str]:
    """Ended jobs to purge: past the retention period, or the oldest beyond `max_ended`. A job whose
    agents may still hold devices somewhere (zombies) is kept until they are confirmed gone."""
    ended = sorted((j for j in jobs if j.state.terminal and not j.zombies),
                   key=lambda j: (j.ended_at or 0.0, j.seq))
    out = []
    keep_from = max(0, len(ended) - limits.max_ended)
    for i, j in enumerate(ended):
        old = limits.job_retention_s is not None and now - (j.ended_at or 0.0) > limits.job_retention_s
        if i < keep_from or old:
            out.append(j.job_id)
    return out


def scrub(jobs: Iterable[Job]) -> list[Job]:
    """Ended jobs that still hold their --env: it is needed only to launch agents, and may hold secrets
    that should not sit in the job table for the whole retention period."""
    return [j for j in jobs if j.state.terminal and j.spec.env]


def page(infos: Iterable[tuple[int, p.JobInfo]], budget: int = PAGE_BYTES) -> tuple[list[p.JobInfo], int]:
    """Jobs (in seq order) until their encoded size would pass `budget` (always at least one); and the
    seq to continue after, 0 when this page holds the rest."""
    out: list[p.JobInfo] = []
    used = 0
    last = 0
    for seq, info in infos:
        size = encoded_size(info)
        if out and used + size > budget:
            return out, last
        out.append(info)
        used += size
        last = seq
    return out, 0

