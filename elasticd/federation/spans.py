"""Jobs that span islands, at the front: a pure state machine of requests, island rows and clock ticks in,
messages for island schedulers out.

    waiting    its islands cannot hold it now (one is not up, or too few devices are free); the reason says
               which. Tried again as islands report.
    reserving  each island was sent `ReservePortion`: its scheduler queues the portion and holds its devices
               once placed ("reserved"). Gang: when every portion is reserved, the job starts; when one is
               not within `reserve_timeout_s`, every portion is cancelled (no island holds devices for a job
               that cannot start) and the job waits again, retried after `retry_s`.
    starting   portion 0 was sent `StartPortion`; its rank 0's node picks the rendezvous port, which its
               island reports; the other portions are then started with it. All agents form one group.
    running    every portion's agents are up.
    moving     it grows live onto an island with free devices (one it lost first) while it has fewer devices
               than it asked for, or shrinks live off ranks an island wants back (a drain, a preemption), its
               agents going on where they are (elasticd/federation/moves.py); then running again.
    recovering a portion failed for the infrastructure's reasons (an agent died, its peers lost their group,
               a node or a whole island was lost): the other portions are stopped and, once each has ended
               or its island is gone, the job is split again over its islands that are up and starts from
               its newest complete periodic snapshot (portions with `restore`). Every agent copies its
               snapshot parts to a node of another island (agent/resize/periodic.py), so losing one island
               loses no part. At most `max_restarts` times; a failure of the script itself is never retried.
    finished / failed / stopped
               every portion finished; one failed and no restart is left (or the script raised), or it was
               stopped on its island; `elasticd stop`.

The front keeps the table on disk (elasticd/federation/store.py, `Span.to_doc`): a restarted front goes on
with its jobs as their islands report their portions again. A live move under way when it stopped is not
kept: such a job restarts from its newest snapshot.
"""

from __future__ import annotations

import logging
import secrets
from dataclasses import dataclass, field

from elasticd import protocol as p
from elasticd.core.failures import is_infrastructure
from elasticd.federation import moves
from elasticd.federation.moves import LiveMove
from elasticd.federation.split import Split, grown, shrunk, split

log = logging.getLogger(__name__)

WAITING, RESERVING, STARTING, RUNNING, RECOVERING = "waiting", "reserving", "starting", "running", "recovering"
MOVING = "moving"
FINISHED, FAILED, STOPPED = "finished", "failed", "stopped"
ENDED = (FINISHED, FAILED, STOPPED)
_ROW_ENDED = ("finished", "failed", "stopped")
RESEND_S = 2.0   # a command whose effect no island row shows yet is sent again after this
KEEP_ENDED = 1000     # ended jobs the front keeps to show (the oldest go first)
MAX_ACTIVE_PER_OWNER = 64   # jobs of one key not ended yet: each holds or asks for devices on every island

Send = tuple[str, p.Message]   # (island id, message for its scheduler)


@dataclass(slots=True)
class Part:
    island: str
    spec: p.PortionSpec
    row: p.PortionRow | None = None
    sent_at: float = 0.0
    started: bool = False      # StartPortion sent

    def state(self) -> str:
        return self.row.state if self.row is not None else ""


@dataclass(slots=True)
class Span:
    span_id: str
    seq: int
    req: p.SubmitSpanning
    owner: str
    submitted_at: float
    state: str = WAITING
    reason: str = "submitted"
    attempt: int = 0
    parts: list[Part] = field(default_factory=list)
    history: list[tuple[float, str, str]] = field(default_factory=list)
    deadline: float = 0.0
    retry_at: float = 0.0
    key: str = field(default_factory=lambda: secrets.token_hex(8))   # its snapshots' name on every node
    restarts: int = 0
    restore: bool = False      # it ran: every later attempt starts from its newest complete snapshot
    planned: tuple[str, ...] = ()   # the islands of its first start: one it lost is offered its portion back first
    move: LiveMove | None = None   # a live move in flight
    move_at: float = 0.0       # no live move before then (one was called off)
    moves: int = 0             # live moves of this attempt (each one's epoch)
    changed: bool = True       # since the front last wrote it to disk

    def go(self, state: str, reason: str, now: float, note: bool = False) -> None:
        """`note`: keep this reason in the history though the state stays."""
        self.changed = True
        if (state, reason) != (self.state, self.reason):
            log.info("job %s %s: %s", self.span_id, state, reason)
        if state != self.state or note:
            self.history.append((round(now, 3), state, reason))
            del self.history[:-100]
        self.state, self.reason = state, reason

    def to_doc(self) -> dict:
        """What the front's table on disk keeps (not the islands' rows, which they report again, nor a live
        move under way)."""
        return {"span_id": self.span_id, "seq": self.seq, "req": self.req.to_wire(), "owner": self.owner,
                "submitted_at": self.submitted_at, "state": self.state, "reason": self.reason,
                "attempt": self.attempt, "history": [list(h) for h in self.history], "deadline": self.deadline,
                "retry_at": self.retry_at, "key": self.key, "restarts": self.restarts, "restore": self.restore,
                "planned": list(self.planned), "move_at": self.move_at, "moves": self.moves,
                "parts": [{"island": pt.island, "spec": p.plain(pt.spec), "started": pt.started} for pt in self.parts]}

    @classmethod
    def from_doc(cls, d: dict, now: float, reserve_timeout_s: float) -> Span:
        """A job read back by a restarted front. One that was moving live restarts from its newest snapshot:
        what the move did on its islands is not known (its portions are cancelled as they report)."""
        span = cls(d["span_id"], d["seq"], p.SubmitSpanning.from_wire(d["req"]), d["owner"], d["submitted_at"],
                   state=d["state"], reason=d["reason"], attempt=d["attempt"],
                   parts=[Part(x["island"], p.PortionSpec(**x["spec"]), started=x["started"]) for x in d["parts"]],
                   history=[(float(a), str(b), str(c)) for a, b, c in d["history"]], deadline=d["deadline"],
                   retry_at=d["retry_at"], key=d["key"], restarts=d["restarts"], restore=d["restore"],
                   planned=tuple(d["planned"]), move_at=d["move_at"], moves=d["moves"], changed=False)
        if span.state == MOVING:
            span.restore, span.deadline = True, now + reserve_timeout_s
            span.go(RECOVERING, "the front restarted during a live move; restarting from the newest complete "
                                "snapshot", now)
        return span

    def info(self) -> p.SpanInfo:
        lead = self.parts[0].row if self.parts else None
        return p.SpanInfo(
            span_id=self.span_id, name=self.req.name, state=self.state, reason=self.reason,
            workers=self.req.workers, devices=sum(pt.spec.devices for pt in self.parts) or self.req.devices,
            owner=self.owner, submitted_at=self.submitted_at, attempt=self.attempt, restarts=self.restarts,
            step=lead.step if lead else 0, steps_per_s=lead.steps_per_s if lead else 0.0,
            portions=[p.PortionInfo(island=pt.island, index=pt.spec.index, devices=pt.spec.devices,
                                    workers=sum(pt.spec.own_blocks),
                                    ranks=_ranks(pt.spec),
                                    job_id=pt.row.job_id if pt.row else "", state=pt.state(),
                                    step=pt.row.step if pt.row else 0, error=pt.row.error if pt.row else "")
                      for pt in self.parts],
            history=list(self.history))


class Spans:
    def __init__(self, reserve_timeout_s: float = 30.0, retry_s: float = 5.0) -> None:
        self.reserve_timeout_s, self.retry_s = reserve_timeout_s, retry_s
        self.spans: dict[str, Span] = {}
        self._seq = 0

    # --- requests --------------------------------------------------------------------------------

    def submit(self, req: p.SubmitSpanning, owner: str, now: float, free: dict[str, int],
               speed: dict[str, float] | None = None) -> tuple[Span, list[Send]]:
        """`free`: the islands up, with their free devices; `speed`: those devices' speeds added up."""
        self._seq += 1
        span = Span(f"s{self._seq}", self._seq, req, owner, now, history=[(round(now, 3), WAITING, "submitted")])
        self.spans[span.span_id] = span
        log.info("job %s submitted: %s workers=%d islands=%s", span.span_id, req.script, req.workers,
                 ",".join(req.islands) or f"any (at most {req.max_islands or 'all'})")
        return span, self._try(span, now, free, speed)

    def load(self, docs: list[dict], now: float) -> None:
        """The table a restarted front read back (elasticd/federation/store.py); a row it cannot read is
        skipped, named in the log."""
        for d in docs:
            try:
                span = Span.from_doc(d, now, self.reserve_timeout_s)
            except Exception as e:  # noqa: BLE001 - one bad row must not keep the front down
                log.error("skipping unreadable job row %s: %s: %s", d.get("span_id"), type(e).__name__, e)
                continue
            self.spans[span.span_id] = span
            self._seq = max(self._seq, span.seq)

    def active(self, owner: str) -> int:
        return sum(s.owner == owner and s.state not in ENDED for s in self.spans.values())

    def stop(self, span_id: str, now: float) -> tuple[str, list[Send]]:
        span = self.get(span_id)
        if span.state in ENDED:
            return f"job {span_id} already {span.state}", []
        out = self._cancel(span, "stopped by user")
        span.go(STOPPED, "stopped by user", now)
        return f"job {span_id} stopped", out

    def get(self, span_id: str) -> Span:
        """Raises: KeyError naming the job."""
        span = self.spans.get(span_id)
        if span is None:
            raise KeyError(f"no job {span_id!r} at this front")
        return span

    def table(self) -> p.SpansReply:
        return p.SpansReply(spans=[s.info() for s in sorted(self.spans.values(), key=lambda s: s.seq)])

    # --- islands ---------------------------------------------------------------------------------

    def rows(self, island: str, rows: list[p.PortionRow], now: float) -> list[Send]:
        """An island's portions as its scheduler has them (every status)."""
        out: list[Send] = []
        touched: list[Span] = []
        for row in rows:
            span = self.spans.get(row.span_id)
            # By island, not by place: a live move changes a portion's place in the job (its island's row may
            # show the new one before the front is done with the move); an island holds one portion of a job.
            part = (next((pt for pt in span.parts if pt.island == island), None)
                    if span is not None and row.attempt == span.attempt else None)
            live = span is not None and span.state in (RESERVING, STARTING, RUNNING, MOVING)
            if part is None or not live:
                # A reservation of an attempt this front released (or of a job a restarted front never
                # knew) holds devices for nothing, and a portion of a job that ended here must stop; a
                # running portion of a job this front never knew runs to its end.
                if part is not None:
                    part.row = row
                if row.state in ("queued", "reserved") or (span is not None and row.state not in _ROW_ENDED):
                    out.append((island, p.CancelPortion(span_id=row.span_id, attempt=row.attempt,
                                                        reason="not a portion this front is starting")))
                continue
            part.row = row
            if span not in touched:
                touched.append(span)
        for span in touched:
            out += self._advance(span, now)
        return out

    def island_lost(self, island: str, why: str, now: float) -> list[Send]:
        out: list[Send] = []
        for span in self.spans.values():
            if not any(pt.island == island for pt in span.parts):
                continue
            if span.state == FAILED and f"island {island} " not in span.reason:
                # Its other portions often fail first (their peers' connections closed): say what caused it.
                span.reason += f"; island {island} was lost ({why})"
            if span.state in ENDED:
                continue
            if span.state == RESERVING:
                out += self._release(span, f"island {island} lost ({why})", now)
            elif span.state == MOVING and span.move is not None and not span.move.went and all(
                    pt.island != island for pt in span.parts[:span.move.old]):
                out += moves.call_off(self, span, f"island {island} lost ({why})", now)
            elif span.state in (STARTING, RUNNING, MOVING):
                out += self.recover(span, f"island {island} lost ({why})", now)
            elif span.state == RECOVERING:   # what its portions' failures came from, seen after them
                span.go(RECOVERING, f"island {island} lost ({why}); {span.reason}", now, note=True)
        return out

    def tick(self, now: float, free: dict[str, int], speed: dict[str, float] | None = None) -> list[Send]:
        ended = [s for s in sorted(self.spans.values(), key=lambda s: s.seq) if s.state in ENDED]
        for s in ended[:max(0, len(ended) - KEEP_ENDED)]:
            del self.spans[s.span_id]
        out: list[Send] = []
        for span in sorted(self.spans.values(), key=lambda s: s.seq):
            if span.state == WAITING and now >= span.retry_at:
                out += self._try(span, now, free, speed)
            elif span.state == RECOVERING:
                out += self._restart(span, now, free, speed)
            elif span.state == RUNNING and now >= span.move_at and (keep := self._keep(span)) is not None:
                out += self._shrink(span, keep, now)
            elif span.state == RUNNING and now >= span.move_at and (back := self._back(span, free)):
                out += self._regrow(span, back, now, free, speed)
            elif span.state == MOVING and span.move is not None and now > span.move.deadline:
                out += moves.expired(self, span, now)
            elif span.state == MOVING:
                out += moves.resend(self, span, now, RESEND_S)
            elif span.state == RESERVING and now > span.deadline:
                late = [pt.island for pt in span.parts if pt.state() != "reserved"]
                out += self._release(span, f"island {', '.join(late)} did not grant its portion within "
                                           f"{self.reserve_timeout_s:.0f}s; released everywhere", now)
            elif span.state not in ENDED:
                out += self._resend(span, now)
        return out

    # --- internals -------------------------------------------------------------------------------

    def _try(self, span: Span, now: float, free: dict[str, int], speed: dict[str, float] | None = None
             ) -> list[Send]:
        s = split(span.req, free, partial=span.restore, speed=speed)
        if isinstance(s, str):
            if span.state == RECOVERING:   # tried again at every tick: the islands' reports bring free devices
                span.go(RECOVERING, f"restarting once devices are free: {s}", now)
            else:
                span.go(WAITING, s, now)
            return []
        span.attempt += 1
        span.move, span.moves = None, 0
        span.parts = [Part(isl, s.portion(span.span_id, span.attempt, k, span.req.workers), sent_at=now)
                      for k, isl in enumerate(s.islands)]
        for pt in span.parts:
            pt.spec.key, pt.spec.restore = span.key, span.restore
        span.deadline = now + self.reserve_timeout_s
        span.go(RESERVING, "reserving " + ", ".join(f"{pt.spec.devices} on {pt.island}" for pt in span.parts), now)
        return [(pt.island, self.reserve_msg(span, pt)) for pt in span.parts]

    def reserve_msg(self, span: Span, pt: Part) -> p.ReservePortion:
        r = span.req
        name = f"{r.name or span.span_id}/{pt.island}"[:128]
        return p.ReservePortion(portion=pt.spec, script=r.script, func=r.func, name=name, cwd=r.cwd,
                                env=dict(r.env), priority=r.priority, snapshot_every=r.snapshot_every,
                                threads=r.threads, owner=span.owner)

    def _advance(self, span: Span, now: float) -> list[Send]:
        if span.state == MOVING:
            return moves.advance(self, span, now)
        states = [pt.state() for pt in span.parts]
        bad = next((pt for pt in span.parts if pt.state() in ("failed", "stopped")), None)
        if span.state == RESERVING:
            if bad is not None:
                why = f"island {bad.island} {bad.state()} its portion" + (f": {bad.row.error}" if bad.row and bad.row.error
                                                                        else "")
                if bad.state() == "failed" and not (bad.row is not None and is_infrastructure(bad.row.cause)):
                    return self.fail(span, why, now)   # refused (a bad request): asking again would be refused again
                return self._release(span, why, now)
            if all(s == "reserved" for s in states):
                span.planned = span.planned or tuple(pt.island for pt in span.parts)
                lead = span.parts[0]
                lead.started, lead.sent_at = True, now
                span.go(STARTING, "every portion reserved; starting portion 0 on " + lead.island, now)
                return [(lead.island, p.StartPortion(span_id=span.span_id, attempt=span.attempt))]
            return []
        if bad is not None:
            return self.portion_ended(span, bad, now)
        out: list[Send] = []
        lead = span.parts[0].row
        if lead is not None and lead.master_port:
            for pt in span.parts[1:]:
                if not pt.started:
                    pt.started, pt.sent_at = True, now
                    out.append((pt.island, self._start(span, lead)))
        if all(s == "finished" for s in states):
            span.go(FINISHED, "every portion finished", now)
        elif span.state == STARTING and all(s in ("running", "finished") for s in states):
            span.go(RUNNING, "every portion's agents are up", now)
        return out

    def portion_ended(self, span: Span, bad: Part, now: float) -> list[Send]:
        """A running portion failed or was stopped on its island: a restart after the infrastructure's
        failure, else the job fails (the script's own error, or stopped there)."""
        why = f"its portion on island {bad.island} {bad.state()}" + (f": {bad.row.error}" if bad.row and bad.row.error
                                                                     else "")
        if bad.row is not None and is_infrastructure(bad.row.cause):
            return self.recover(span, why, now)
        return self.fail(span, why, now)

    def _start(self, span: Span, lead: p.PortionRow) -> p.StartPortion:
        return p.StartPortion(span_id=span.span_id, attempt=span.attempt, master_addr=lead.master_addr,
                              master_port=lead.master_port)

    def _resend(self, span: Span, now: float) -> list[Send]:
        """What an island should have got but does not show yet (a message lost with a reconnect)."""
        out: list[Send] = []
        lead = span.parts[0].row if span.parts else None
        for pt in span.parts:
            if now - pt.sent_at < RESEND_S:
                continue
            if span.state == RESERVING and pt.row is None:
                pt.sent_at = now
                out.append((pt.island, self.reserve_msg(span, pt)))
            elif pt.started and pt.state() == "reserved":
                pt.sent_at = now
                if pt.spec.index == 0:
                    out.append((pt.island, p.StartPortion(span_id=span.span_id, attempt=span.attempt)))
                elif lead is not None and lead.master_port:
                    out.append((pt.island, self._start(span, lead)))
        return out

    def _cancel(self, span: Span, reason: str) -> list[Send]:
        span.move = None   # a live move in flight ends with the attempt
        return [(pt.island, p.CancelPortion(span_id=span.span_id, attempt=span.attempt, reason=reason))
                for pt in span.parts if pt.state() not in _ROW_ENDED]

    def _release(self, span: Span, reason: str, now: float) -> list[Send]:
        out = self._cancel(span, f"reservation released: {reason}")
        span.retry_at = now + self.retry_s
        span.go(WAITING, reason, now)
        return out

    def recover(self, span: Span, reason: str, now: float) -> list[Send]:
        """An infrastructure failure: stop what is left, then `_restart` (or fail: no restart left)."""
        if span.restarts >= span.req.max_restarts:
            return self.fail(span, f"{reason}; not restarting: {span.restarts} restart(s) of --max-restarts "
                                    f"{span.req.max_restarts} used", now)
        out = self._cancel(span, f"job {span.span_id} restarting: {reason}")
        span.restarts += 1
        span.restore = True
        span.deadline = now + self.reserve_timeout_s
        span.go(RECOVERING, f"{reason}; restarting from its newest complete snapshot (restart {span.restarts} of "
                            f"{span.req.max_restarts})", now)
        return out

    def _back(self, span: Span, free: dict[str, int]) -> list[str]:
        """Islands up with free devices that it may grow onto while it has fewer devices than it asked for:
        those of its first start it lost first, then any other its request allows (`--islands`, or up to
        `--max-islands`), the most free devices first."""
        have = {pt.island for pt in span.parts}
        if sum(pt.spec.devices for pt in span.parts) >= (span.req.devices or span.req.workers):
            return []
        others = span.req.islands or sorted(free, key=lambda i: (-free[i], i))
        room = (span.req.max_islands or p.MAX_SPAN_ISLANDS) - len(have)
        order = [*span.planned, *(i for i in others if i not in span.planned)]
        return [i for i in order if i not in have and free.get(i, 0) > 0][:max(0, room)]

    def _regrow(self, span: Span, back: list[str], now: float, free: dict[str, int],
                speed: dict[str, float] | None) -> list[Send]:
        """An island it lost is back: the job grows onto it live (elasticd/federation/moves.py)."""
        s = grown(span.req, [(pt.island, pt.spec.devices) for pt in span.parts], back, free, speed)
        if isinstance(s, str):
            span.move_at = now + moves.RETRY_S
            return []
        mv = self._begin(span, s, [], now)
        span.parts += [Part(isl, mv.specs[k], sent_at=now) for k, isl in enumerate(s.islands) if k >= mv.old]
        joining = ", ".join(f"{pt.spec.devices} on {pt.island}" for pt in span.parts[mv.old:])
        span.go(MOVING, f"growing live onto {joining}: {mv.devices_from} -> {s.world} agents", now)
        return [(pt.island, self.reserve_msg(span, pt)) for pt in span.parts[mv.old:]]

    def _keep(self, span: Span) -> list[int] | None:
        """The ranks it keeps when it moves off those its islands want back (None: none is wanted back, or
        every one is: a drain of them all fails it at the drain's deadline, and the front restarts it)."""
        leaving = {r for pt in span.parts if pt.row is not None for r in pt.row.leaving}
        world = sum(pt.spec.devices for pt in span.parts)
        keep = [r for r in range(world) if r not in leaving]
        return keep if leaving and keep else None

    def _shrink(self, span: Span, keep: list[int], now: float) -> list[Send]:
        s = shrunk(span.req, [(pt.island, pt.spec.devices) for pt in span.parts], keep)
        mv = self._begin(span, s, keep, now)
        span.go(MOVING, f"moving live off {mv.devices_from - len(keep)} device(s) its islands want back: "
                        f"{mv.devices_from} -> {s.world} agents", now)
        for pt in span.parts:
            pt.sent_at = now
        return moves.move_msgs(span, mv)

    def _begin(self, span: Span, s: Split, keep: list[int], now: float) -> LiveMove:
        mv = span.move = moves.plan(span, s, keep, now + self.reserve_timeout_s)
        span.moves = mv.epoch
        return mv

    def _restart(self, span: Span, now: float, free: dict[str, int], speed: dict[str, float] | None = None
                 ) -> list[Send]:
        """Once no portion of the failed attempt runs (each ended, or its island is gone), split it again; or
        after `reserve_timeout_s` in any case (an island that forgot its portion never reports it ended)."""
        if now <= span.deadline and any(pt.state() not in _ROW_ENDED and pt.island in free for pt in span.parts):
            return []   # a cancel goes again with each island row that still shows its portion (`rows`)
        return self._try(span, now, free, speed)

    def fail(self, span: Span, reason: str, now: float) -> list[Send]:
        out = self._cancel(span, f"job {span.span_id} failed: {reason}")
        span.go(FAILED, reason, now)
        return out


def _ranks(spec: p.PortionSpec) -> str:
    """A portion's ranks as `islands --jobs` shows them: "2-3", or "2" for one."""
    last = spec.rank_offset + spec.devices - 1
    return str(last) if spec.devices == 1 else f"{spec.rank_offset}-{last}"
