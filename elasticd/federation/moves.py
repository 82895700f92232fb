"""A running job spanning islands grows onto an island live: the front's half of the move.

When an island the job lost is back with free devices (elasticd/federation/spans.py `tick`), the job
does not stop: its agents keep their ranks, devices and processes, and the island's new agents join
them at a step boundary, as a live resize does inside one island (elasticd/scheduler/resizing.py), with
the island schedulers executing the parts (elasticd/scheduler/portion_moves.py):

1. the grown layout (elasticd/federation/split.py `grown`): the joining island's agents come after
   the others, so every island stays a run of consecutive ranks; the workers are laid out again over
   all of them. The joining island gets `ReservePortion` with `join_from` and holds its devices.
2. once it holds them: `StartPortion` starts its agents as warm joiners, and every running portion gets
   `GrowPortion`; the one hosting rank 0 picks the new group's port.
3. once every portion is ready (the joiners said hello, the port is known): `GoPortion` to every island.
   The running agents stop at their next step boundary, the group re-forms across the islands with the
   new islands' two-level sums, and the workers that change agent move point to point.
4. moved: every portion reports its agents re-formed and a step completed after it.

A move that is not ready within the reservation timeout, or whose joining island fails or refuses its
portion, is called off before the go: the joining portion is cancelled, the running ones drop the move
and the job goes on where it ran; the island is offered again after `REGROW_AFTER_S`. After the go, a
failure, or a move not done within `GO_TIMEOUT_S`, restarts the whole job from its newest snapshot, as
any failure does; agents that refused the move (a state they cannot carry) go on as they were.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elasticd import protocol as p
from elasticd.core.failures import is_infrastructure

if TYPE_CHECKING:
    from elasticd.federation.spans import Send, Span, Spans
    from elasticd.federation.split import Split

log = logging.getLogger(__name__)

REGROW_AFTER_S = 60.0   # an island whose joining was called off is offered again after this
GO_TIMEOUT_S = 120.0    # from the go to every portion moved


@dataclass(slots=True)
class Grow:
    epoch: int
    joining: int                  # span.parts[joining:] are the portions that join
    specs: list[p.PortionSpec]    # every portion once moved, in part order
    devices_from: int
    deadline: float
    started: bool = False         # the joiners were started and the running portions told
    went: bool = False
    addr: str = ""                # the new group's rendezvous, once it went
    port: int = 0


def plan(span: Span, s: Split, deadline: float) -> Grow:
    """The next move of `span` onto the grown split `s` (its first portions are the running ones)."""
    epoch = span.moves + 1
    old = len(span.parts)
    specs = [s.portion(span.span_id, span.attempt, k, span.req.workers) for k in range(len(s.islands))]
    for k, spec in enumerate(specs):
        spec.key, spec.restore, spec.epoch = span.key, span.restore, epoch
        if k >= old:
            spec.join_from = sum(s.devices[:old])
    return Grow(epoch, old, specs, sum(s.devices[:old]), deadline=deadline)


def advance(spans: Spans, span: Span, now: float) -> list[Send]:
    g = span.grow
    assert g is not None
    running, joining = span.parts[:g.joining], span.parts[g.joining:]
    bad = next((pt for pt in running if pt.state() in ("failed", "stopped")), None)
    if bad is not None:
        why = f"its portion on island {bad.island} {bad.state()}" + (f": {bad.row.error}" if bad.row and bad.row.error
                                                                     else "")
        if bad.row is not None and is_infrastructure(bad.row.cause):
            return spans.recover(span, why, now)
        return spans.fail(span, why, now)
    failed = next((pt for pt in joining if pt.state() in ("failed", "stopped")), None)
    refused = next((pt for pt in span.parts if pt.row is not None and pt.row.move_epoch == g.epoch
                    and pt.row.move_error), None)
    if failed is not None or refused is not None:
        why = (f"island {failed.island} {failed.state()} its portion: {failed.row.error if failed.row else ''}"
               if failed is not None else f"island {refused.island}: {refused.row.move_error if refused.row else ''}")
        if g.went and refused is None:
            return spans.recover(span, f"growing onto it failed after the go: {why}", now)
        return call_off(spans, span, why, now)
    if not g.started:
        if all(pt.state() == "reserved" for pt in joining):
            g.started, g.deadline = True, now + spans.reserve_timeout_s
            for pt in joining:
                pt.started, pt.sent_at = True, now
            return ([(pt.island, p.StartPortion(span_id=span.span_id, attempt=span.attempt)) for pt in joining]
                    + [(run.island, grow_msg(g, k)) for k, run in enumerate(running)])
        return []
    if not g.went:
        lead = span.parts[0].row
        ready = all(pt.row is not None and pt.row.move_epoch == g.epoch and pt.row.move_ready for pt in span.parts)
        if ready and lead is not None and lead.move_port:
            g.went, g.deadline, g.addr, g.port = True, now + GO_TIMEOUT_S, lead.move_addr, lead.move_port
            log.info("job %s: move %d goes at %s:%d", span.span_id, g.epoch, g.addr, g.port)
            for pt in span.parts:
                pt.sent_at = now
            return [(pt.island, go_msg(span, g)) for pt in span.parts]
        return []
    if all(pt.row is not None and pt.row.move_epoch == g.epoch and pt.row.moved for pt in span.parts):
        for pt, spec in zip(span.parts, g.specs, strict=True):
            pt.spec = spec
        span.grow = None
        islands = ", ".join(pt.island for pt in span.parts[g.joining:])
        span.go("running", f"grew live onto island {islands}: {span.parts[-1].spec.world} agents "
                           f"(move {g.epoch})", now, note=True)
    return []


def grow_msg(g: Grow, k: int) -> p.GrowPortion:
    return p.GrowPortion(portion=g.specs[k], devices_from=g.devices_from)


def go_msg(span: Span, g: Grow) -> p.GoPortion:
    return p.GoPortion(span_id=span.span_id, attempt=span.attempt, epoch=g.epoch, master_addr=g.addr, master_port=g.port)


def expired(spans: Spans, span: Span, now: float) -> list[Send]:
    """The move's deadline passed: called off before the go, a restart after it."""
    g = span.grow
    assert g is not None
    if g.went:
        return spans.recover(span, f"growing live (move {g.epoch}) did not finish within {GO_TIMEOUT_S:.0f}s", now)
    late = [pt.island for pt in span.parts if not (pt.row is not None and pt.row.move_ready
                                                     and pt.row.move_epoch == g.epoch)]
    return call_off(spans, span, f"island {', '.join(late)} not ready within {spans.reserve_timeout_s:.0f}s", now)


def call_off(spans: Spans, span: Span, why: str, now: float) -> list[Send]:
    """Before the go: the joining portions are cancelled, the running ones drop the move; the job goes on."""
    g = span.grow
    assert g is not None
    running, joining = span.parts[:g.joining], span.parts[g.joining:]
    out: list[Send] = [(pt.island, p.CancelPortion(span_id=span.span_id, attempt=span.attempt, reason=why))
                       for pt in joining]
    out += [(pt.island, p.AbortPortionMove(span_id=span.span_id, attempt=span.attempt, epoch=g.epoch, reason=why))
            for pt in running]
    span.parts = running
    span.grow = None
    span.grow_at = now + REGROW_AFTER_S
    span.go("running", f"growing live called off ({why}); runs on as it was, offered again in "
                       f"{REGROW_AFTER_S:.0f}s", now, note=True)
    return out


def resend(spans: Spans, span: Span, now: float, resend_s: float) -> list[Send]:
    """What an island should have got for the move but does not show yet (a message lost with a reconnect).
    Each command is idempotent on its island."""
    g = span.grow
    assert g is not None
    out: list[Send] = []
    for k, pt in enumerate(span.parts):
        if now - pt.sent_at < resend_s:
            continue
        row, msg = pt.row, None
        if g.went and not (row is not None and row.move_epoch == g.epoch and row.moved):
            msg = go_msg(span, g)
        elif k < g.joining and g.started and not g.went and (row is None or row.move_epoch != g.epoch):
            msg = grow_msg(g, k)
        elif k >= g.joining and row is None:
            msg = spans.reserve_msg(span, pt)
        elif k >= g.joining and pt.started and pt.state() == "reserved":
            msg = p.StartPortion(span_id=span.span_id, attempt=span.attempt)
        if msg is not None:
            pt.sent_at = now
            out.append((pt.island, msg))
    return out
