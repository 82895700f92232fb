"""A running job spanning islands moves live: the front's half. It grows onto an island with free devices
(one it lost, back), or shrinks off ranks an island wants back (a drain, a preemption), without stopping.

Its agents that stay keep their devices and processes; at a step boundary the group re-forms across the
islands, as a live resize does inside one island (elasticd/scheduler/resizing.py), with the island
schedulers executing the parts (elasticd/scheduler/portion_moves.py):

1. the new layout. A grow (elasticd/federation/split.py `grown`) puts the joining island's agents after
   the others; a shrink (`shrunk`) keeps every other rank in order, dropping a portion none of whose
   agents stays. Either way each island stays a run of consecutive ranks, and the N workers are laid
   out again over the agents. A joining island gets `ReservePortion` with `join_from` and holds its
   devices.
2. once it holds them (at once for a shrink): `StartPortion` starts the joiners warm, and every running
   portion gets `MovePortion`; the one hosting the new rank 0 picks the new group's port.
3. once every portion is ready (joiners said hello, the port is known): `GoPortion` to every island. The
   agents stop at their next step boundary, leavers hand their workers over and exit, joiners join, and
   the group re-forms with the new islands' two-level sums.
4. moved: every portion reports its part done. The job runs on the new portions; one whose agents all
   left is cancelled on its island.

A move that is not ready within the reservation timeout, or whose joining island fails or refuses its
portion, or whose agents refuse it (a state they cannot carry), is called off before anything moved: the
joining portion is cancelled, the running ones drop the move and the job goes on where it ran; the same
move is offered again after `RETRY_S`. A failure after the go, or a move not done within `GO_TIMEOUT_S`,
restarts the whole job from its newest snapshot, as any failure does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from elasticd import protocol as p

if TYPE_CHECKING:
    from elasticd.federation.spans import Part, Send, Span, Spans
    from elasticd.federation.split import Split

log = logging.getLogger(__name__)

RETRY_S = 60.0        # a move called off is offered again after this
GO_TIMEOUT_S = 120.0  # from the go to every portion moved
_ENDED = ("finished", "failed", "stopped")


@dataclass(slots=True)
class LiveMove:
    epoch: int
    split: Split                  # the job after it
    keep: list[int]               # the old ranks that stay, in new rank order (empty: all of them, a grow)
    devices_from: int
    old: int                      # span.parts[:old] ran before it; span.parts[old:] join
    index: list[int]              # each old part's portion index after it (-1: it leaves the job)
    lead: int                     # the old part hosting the new rank 0 (it picks the port)
    deadline: float
    started: bool = False         # the joiners were started and the running portions told
    went: bool = False
    addr: str = ""                # the new group's rendezvous, once it went
    port: int = 0
    specs: list[p.PortionSpec] = field(default_factory=list)   # the portions after it, in rank order

    @property
    def grow(self) -> bool:
        return not self.keep


def plan(span: Span, s: Split, keep: list[int], deadline: float) -> LiveMove:
    """The next move of `span` to the split `s`; `keep` empty: a grow whose new islands come after its
    running ones; else a shrink to those old ranks (`s` already without the portions that leave)."""
    epoch = span.moves + 1
    old = len(span.parts)
    world = sum(pt.spec.devices for pt in span.parts)
    if keep:
        stays = {pt.island for pt in span.parts if any(pt.spec.rank_offset <= r < pt.spec.rank_offset + pt.spec.devices
                                                       for r in keep)}
        index = [s.islands.index(pt.island) if pt.island in stays else -1 for pt in span.parts]
        lead = next(k for k, pt in enumerate(span.parts)
                    if pt.spec.rank_offset <= keep[0] < pt.spec.rank_offset + pt.spec.devices)
    else:
        index, lead = list(range(old)), 0
    specs = [s.portion(span.span_id, span.attempt, k, span.req.workers) for k in range(len(s.islands))]
    for k, spec in enumerate(specs):
        spec.key, spec.restore, spec.epoch = span.key, span.restore, epoch
        if not keep and k >= old:
            spec.join_from = world
    return LiveMove(epoch, s, list(keep), world, old, index, lead, deadline, started=bool(keep), specs=specs)


def move_msgs(span: Span, mv: LiveMove) -> list[Send]:
    s = mv.split
    return [(pt.island, p.MovePortion(span_id=span.span_id, attempt=span.attempt, epoch=mv.epoch,
                                      devices_from=mv.devices_from, world=s.world, blocks=list(s.blocks),
                                      islands=list(s.devices), keep=list(mv.keep), index=mv.index[k]))
            for k, pt in enumerate(span.parts[:mv.old])]


def advance(spans: Spans, span: Span, now: float) -> list[Send]:
    mv = span.move
    assert mv is not None
    running, joining = span.parts[:mv.old], span.parts[mv.old:]
    bad = next((pt for k, pt in enumerate(running) if pt.state() in ("failed", "stopped")
                and not _moved(pt, mv, leaves=mv.index[k] < 0)), None)
    if bad is not None:
        return spans.portion_ended(span, bad, now)
    failed = next((pt for pt in joining if pt.state() in ("failed", "stopped")), None)
    refused = next((pt for pt in span.parts if pt.row is not None and pt.row.move_epoch == mv.epoch
                    and pt.row.move_error), None)
    if failed is not None or refused is not None:
        why = (f"island {failed.island} {failed.state()} its portion: {failed.row.error if failed.row else ''}"
               if failed is not None else f"island {refused.island}: {refused.row.move_error if refused.row else ''}")
        if mv.went and refused is None:
            return spans.recover(span, f"moving live failed after the go: {why}", now)
        return call_off(spans, span, why, now)
    if not mv.started:
        if all(pt.state() == "reserved" for pt in joining):
            mv.started, mv.deadline = True, now + spans.reserve_timeout_s
            for pt in span.parts:
                pt.started, pt.sent_at = True, now
            return [(pt.island, p.StartPortion(span_id=span.span_id, attempt=span.attempt)) for pt in joining] \
                + move_msgs(span, mv)
        return []
    if not mv.went:
        lead = span.parts[mv.lead].row
        if all(_ready(pt, mv) for pt in span.parts) and lead is not None and lead.move_port:
            mv.went, mv.deadline, mv.addr, mv.port = True, now + GO_TIMEOUT_S, lead.move_addr, lead.move_port
            log.info("job %s: move %d goes at %s:%d", span.span_id, mv.epoch, mv.addr, mv.port)
            for pt in span.parts:
                pt.sent_at = now
            return [(pt.island, go_msg(span, mv)) for pt in span.parts]
        return []
    if not all(_moved(pt, mv, leaves=k < mv.old and mv.index[k] < 0) for k, pt in enumerate(span.parts)):
        return []
    leave = [pt for k, pt in enumerate(running) if mv.index[k] < 0]
    after = sorted((pt for k, pt in enumerate(span.parts) if k >= mv.old or mv.index[k] >= 0),
                   key=lambda pt: mv.split.islands.index(pt.island))
    for k, pt in enumerate(after):
        pt.spec = mv.specs[k]
    span.parts, span.move = after, None
    out: list[Send] = [(pt.island, p.CancelPortion(span_id=span.span_id, attempt=span.attempt,
                                                   reason=f"its agents left job {span.span_id} (move {mv.epoch})"))
                       for pt in leave if pt.state() not in _ENDED]
    gone = [pt.island for pt in leave]
    what = (f"grew live onto island {', '.join(pt.island for pt in joining)}" if mv.grow else
            f"moved live off {mv.devices_from - len(mv.keep)} device(s) its islands wanted back"
            + (f", leaving island {', '.join(gone)}" if gone else ""))
    span.go("running", f"{what}: {mv.split.world} agents (move {mv.epoch})", now, note=True)
    return out


def _ready(pt: Part, mv: LiveMove) -> bool:
    return pt.row is not None and pt.row.move_epoch == mv.epoch and pt.row.move_ready


def _moved(pt: Part, mv: LiveMove, leaves: bool = False) -> bool:
    """`leaves`: a portion whose agents all leave may end (its island job finishes as they exit) before
    its row says moved."""
    if pt.row is None:
        return False
    return pt.row.move_epoch == mv.epoch and pt.row.moved or (leaves and mv.went and pt.row.state in _ENDED)


def go_msg(span: Span, mv: LiveMove) -> p.GoPortion:
    return p.GoPortion(span_id=span.span_id, attempt=span.attempt, epoch=mv.epoch, master_addr=mv.addr,
                       master_port=mv.port)


def expired(spans: Spans, span: Span, now: float) -> list[Send]:
    """The move's deadline passed: called off before the go, a restart after it."""
    mv = span.move
    assert mv is not None
    if mv.went:
        return spans.recover(span, f"moving live (move {mv.epoch}) did not finish within {GO_TIMEOUT_S:.0f}s", now)
    late = [pt.island for pt in span.parts if not _ready(pt, mv)]
    return call_off(spans, span, f"island {', '.join(late)} not ready within {spans.reserve_timeout_s:.0f}s", now)


def call_off(spans: Spans, span: Span, why: str, now: float) -> list[Send]:
    """Before anything moved: the joining portions are cancelled, the running ones drop the move; the job
    goes on as it was."""
    mv = span.move
    assert mv is not None
    running, joining = span.parts[:mv.old], span.parts[mv.old:]
    out: list[Send] = [(pt.island, p.CancelPortion(span_id=span.span_id, attempt=span.attempt, reason=why))
                       for pt in joining]
    out += [(pt.island, p.AbortPortionMove(span_id=span.span_id, attempt=span.attempt, epoch=mv.epoch, reason=why))
            for pt in running]
    span.parts, span.move = running, None
    span.move_at = now + RETRY_S
    span.go("running", f"moving live called off ({why}); runs on as it was, offered again in {RETRY_S:.0f}s",
            now, note=True)
    return out


def resend(spans: Spans, span: Span, now: float, resend_s: float) -> list[Send]:
    """What an island should have got for the move but does not show yet (a message lost with a reconnect).
    Each command is idempotent on its island."""
    mv = span.move
    assert mv is not None
    out: list[Send] = []
    moves = dict(enumerate(move_msgs(span, mv))) if mv.started and not mv.went else {}
    for k, pt in enumerate(span.parts):
        if now - pt.sent_at < resend_s:
            continue
        row, msg = pt.row, None
        if mv.went and not _moved(pt, mv, leaves=k < mv.old and mv.index[k] < 0):
            msg = go_msg(span, mv)
        elif k in moves and (row is None or row.move_epoch != mv.epoch):
            msg = moves[k][1]
        elif k >= mv.old and row is None:
            msg = spans.reserve_msg(span, pt)
        elif k >= mv.old and pt.started and pt.state() == "reserved":
            msg = p.StartPortion(span_id=span.span_id, attempt=span.attempt)
        if msg is not None:
            pt.sent_at = now
            out.append((pt.island, msg))
    return out
