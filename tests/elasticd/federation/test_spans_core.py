"""Jobs spanning islands, driven by hand with a fake clock: the front's split and its state machine
(elasticd/federation/spans.py), and an island scheduler's side of a portion (elasticd/scheduler/portions.py),
each fed what the other sends."""

from __future__ import annotations

import dataclasses

import pytest
from island_core import Island, agent, launches, report

from elasticd import protocol as p
from elasticd.federation import authz
from elasticd.federation.spans import Spans
from elasticd.federation.split import split
from elasticd.scheduler.authz import Principal
from elasticd.scheduler.jobs import JobState


def req(workers: int = 8, devices: int = 0, islands: tuple[str, ...] = ("A", "B"), max_islands: int = 0
        ) -> p.SubmitSpanning:
    return p.SubmitSpanning(script="/s.py", workers=workers, devices=devices, islands=list(islands),
                            max_islands=max_islands)


# --- the split -------------------------------------------------------------------------------------

def test_devices_go_in_proportion_to_free_devices_and_ranks_follow_the_islands_order():
    s = split(req(workers=8), {"A": 2, "B": 2})
    assert (s.islands, s.devices, s.blocks) == (("A", "B"), (2, 2), (2, 2, 2, 2))
    s = split(req(workers=8, devices=4), {"A": 3, "B": 2, "C": 9})
    assert (s.islands, s.devices) == (("A", "B"), (2, 2))
    s = split(req(workers=12, devices=6, islands=("B", "A")), {"A": 4, "B": 2})
    assert (s.islands, s.devices, s.blocks) == (("B", "A"), (2, 4), (2,) * 6)
    spec = s.portion("s1", 1, 1, 12)
    assert (spec.rank_offset, spec.devices, spec.own_blocks, spec.world) == (2, 4, [2, 2, 2, 2], 6)
    assert spec.check() is None
    # N not divisible by M: the uniform layout's blocks, cut where the islands cut the ranks
    s = split(req(workers=7, devices=3), {"A": 1, "B": 2})
    assert (s.devices, s.blocks) == ((1, 2), (3, 2, 2))


def test_the_front_picks_islands_with_the_most_free_devices_up_to_max_islands():
    s = split(req(workers=8, islands=()), {"A": 1, "B": 5, "C": 3})
    assert (s.islands, s.devices) == (("B", "C"), (5, 3))
    s = split(req(workers=8, islands=(), max_islands=1), {"A": 1, "B": 5, "C": 3})
    assert (s.islands, s.devices) == (("B",), (5,))


@pytest.mark.parametrize("free, devices, why", [
    ({"A": 2}, 0, "island B is not up"),
    ({"A": 2, "B": 0}, 0, "island B has no free device"),
    ({"A": 2, "B": 1}, 4, "4 devices wanted, 3 free on its islands (A 2, B 1)"),
])
def test_a_split_that_cannot_be_made_now_says_why(free, devices, why):
    assert why in split(req(workers=8, devices=devices), free)


# --- the front and two islands, hand in hand ----------------------------------------------------------

class Front:
    """The front's spans, with two island cores: what one sends is delivered to the other."""

    def __init__(self, devices: dict[str, int], reserve_timeout_s: float = 30.0) -> None:
        self.spans = Spans(reserve_timeout_s=reserve_timeout_s, retry_s=5.0)
        self.isl = {name: Island() for name in devices}
        for name, isl in self.isl.items():
            isl.hello(f"{name.lower()}1", devices[name])
        self.now = 100.0
        self.launched: dict[str, list[p.LaunchJob]] = {name: [] for name in devices}

    def free(self) -> dict[str, int]:
        return {name: isl.s.free_count() for name, isl in self.isl.items()}

    def deliver(self, sends) -> None:
        for island, msg in sends:
            out = self.isl[island]._take(self.isl[island].s.portions.apply(msg, self.isl[island].now))
            self.launched[island] += [m for _n, m in launches(out)]

    def beat(self) -> None:
        """Every island's status: its portion rows go to the front, and what the front answers back."""
        for name, isl in self.isl.items():
            self.deliver(self.spans.rows(name, isl.s.portions.rows(), self.now))

    def tick(self, dt: float) -> None:
        self.now += dt
        for name, isl in self.isl.items():
            isl.now += dt
            isl.report(f"{name.lower()}1")   # its node's heartbeat
            isl.tick(0.0)
        self.deliver(self.spans.tick(self.now, self.free()))

    def job(self, island: str):
        (job,) = [j for j in self.isl[island].s.jobs.values() if j.spec.portion is not None and not j.state.terminal]
        return job


def test_portions_are_held_until_every_island_holds_one_then_start_at_one_rendezvous_and_finish():
    f = Front({"A": 2, "B": 2})
    span, out = f.spans.submit(req(workers=8), "alice", f.now, f.free())
    f.deliver(out)
    a, b = f.job("A"), f.job("B")
    # held, nothing launched: no agent starts before the whole job can
    assert a.state is b.state is JobState.RESERVED and not f.launched["A"] and not f.launched["B"]
    assert f.isl["A"].s.free_count() == 0 and span.state == "reserving"
    f.beat()
    assert span.state == "starting"
    (lead,) = f.launched["A"]   # portion 0: its rank 0's node, which picks the port
    assert (lead.workers, lead.devices, [pl.rank for pl in lead.placements], lead.blocks) == (8, 4, [0, 1], [2, 2, 2, 2])
    assert lead.env["ELASTICD_ISLANDS"] == "2,2" and lead.master_port == 0 and not f.launched["B"]
    f.isl["A"].report("a1", report(a.job_id, [agent(0, 0), agent(1, 1)], master_port=4242))
    f.beat()
    (other,) = f.launched["B"]
    assert [pl.rank for pl in other.placements] == [2, 3] and (other.master_addr, other.master_port) == ("a1.host", 4242)
    assert other.devices == 4 and other.workers == 8
    f.isl["B"].report("b1", report(b.job_id, [agent(2, 0), agent(3, 1)]))
    f.beat()
    assert span.state == "running"
    assert "portion 2 of 2: ranks 2-3 of 4, 4 of its 8 workers" in f.isl["B"].s.status(b.job_id, f.now).jobs[0].portion_of
    for name, node, ranks in (("A", "a1", (0, 1)), ("B", "b1", (2, 3))):
        job = f.job(name)
        f.isl[name].report(node, report(job.job_id, [agent(r, i, alive=False, exitcode=0) for i, r in enumerate(ranks)],
                                        state="ended"))
    f.beat()
    assert span.state == "finished" and f.spans.table().spans[0].portions[1].state == "finished"


def test_a_portion_an_island_cannot_place_in_time_releases_every_reservation_and_the_job_waits_again():
    f = Front({"A": 2, "B": 2}, reserve_timeout_s=10.0)
    f.isl["B"].submit(workers=2, lo=2, hi=2)   # B's own job takes its devices after B reported them free
    span, out = f.spans.submit(req(workers=8), "alice", f.now, {"A": 2, "B": 2})
    f.deliver(out)
    f.beat()
    assert f.job("A").state is JobState.RESERVED and f.job("B").state is JobState.QUEUED
    assert span.state == "reserving" and f.isl["A"].s.free_count() == 0
    f.tick(11.0)
    assert span.state == "waiting" and "island B did not grant its portion within 10s; released everywhere" in span.reason
    assert f.isl["A"].s.free_count() == 2, "A still holds devices for a job that cannot start"
    assert not any(j.spec.portion and not j.state.terminal for isl in f.isl.values() for j in isl.s.jobs.values())
    f.tick(1.0)
    assert "released everywhere" in span.reason   # not retried before retry_s
    f.tick(5.0)
    assert span.state == "waiting" and "island B has no free device" in span.reason   # retried: B is full
    assert not f.launched["A"] and not f.launched["B"]


def started(f: Front, req_: p.SubmitSpanning):
    span, out = f.spans.submit(req_, "alice", f.now, f.free())
    f.deliver(out)
    f.beat()
    a = f.job("A")
    f.isl["A"].report("a1", report(a.job_id, [agent(0, 0), agent(1, 1)], master_port=4242))
    f.beat()
    return span, a


def on_a_alone(**kw):
    """A job over A and B that lost B: restarted on A alone, from its snapshot, and running there."""
    f = Front({"A": 2, "B": 2}, **kw)
    span, a = started(f, req(workers=8))
    key = span.parts[0].spec.key
    f.deliver(f.spans.island_lost("B", "no status for 11s", f.now))
    assert span.state == "recovering" and "island B lost (no status for 11s); restarting" in span.reason
    assert a.state is JobState.STOPPED
    f.isl["A"].report("a1", report(a.job_id, [agent(0, 0, alive=False), agent(1, 1, alive=False)], state="ended"))
    del f.isl["B"]   # gone: it reports nothing any more
    f.deliver(f.spans.tick(f.now + 0.1, {"A": 2}))
    assert span.state == "recovering", "restarted before its island said its portion there had stopped"
    f.beat()
    f.deliver(f.spans.tick(f.now + 0.2, {"A": 2}))
    a2 = f.job("A")
    assert a2.job_id != a.job_id and a2.state is JobState.RESERVED
    assert (a2.spec.portion.world, a2.spec.portion.blocks, a2.spec.portion.key, a2.spec.portion.restore) == (
        2, [4, 4], key, True)
    f.beat()
    (launch,) = f.launched["A"][-1:]
    assert launch.restore_latest and launch.snapshot_key == key and launch.workers == 8 and launch.devices == 2
    assert "ELASTICD_ISLANDS" not in launch.env   # one island: one level of sums
    assert span.state == "starting" and span.restarts == 1 and span.attempt == 2
    f.isl["A"].report("a1", report(a2.job_id, [agent(0, 0), agent(1, 1)], master_port=4243))
    f.beat()
    assert span.state == "running"
    return f, span, a2


def test_a_lost_island_restarts_the_job_on_the_islands_left_from_its_snapshot_under_the_same_key():
    on_a_alone()


def b_is_back(f: Front, devices: int = 2) -> None:
    f.isl["B"] = Island()
    f.isl["B"].hello("b1", devices)
    f.launched["B"] = []


def sent_to(isl: Island, kind) -> list:
    return [(m.node_id, m.msg) for m in isl.sent if isinstance(m.msg, kind)]


def test_an_island_back_is_grown_onto_live_its_agents_joining_the_running_ones():
    f, span, a = on_a_alone()
    key = span.parts[0].spec.key
    f.deliver(f.spans.tick(f.now + 0.3, {"A": 0}))
    assert span.state == "running"   # B is not back
    b_is_back(f)
    f.deliver(f.spans.tick(f.now + 0.4, f.free()))
    # B holds its devices for a portion joining the 2 agents on A; A's agents go on training meanwhile
    assert span.state == "moving" and "growing live onto 2 on B: 2 -> 4 agents" in span.reason
    b = f.job("B")
    spec = b.spec.portion
    assert (b.state, spec.join_from, spec.epoch, spec.rank_offset, spec.world, spec.islands, spec.key) == (
        JobState.RESERVED, 2, 1, 2, 4, [2, 2], key)
    assert a.state is JobState.RUNNING and not [m for _n, m in sent_to(f.isl["A"], p.KillJob) if m.job_id == a.job_id]
    f.beat()   # B reserved: its joiners start warm, and A's rank 0's node picks the new group's port
    ((node, prep_b),) = sent_to(f.isl["B"], p.PrepareResize)
    assert (node, [(j.rank, j.device_id) for j in prep_b.joiners], prep_b.devices_from, prep_b.devices) == (
        "b1", [(2, "cpu:0"), (3, "cpu:1")], 2, 4)
    assert prep_b.env["ELASTICD_ISLANDS"] == "2,2" and prep_b.snapshot_key == key and prep_b.blocks == [2, 2, 2, 2]
    ((node, prep_a),) = sent_to(f.isl["A"], p.PrepareResize)
    assert (node, prep_a.pick_port, prep_a.joiners, prep_a.epoch) == ("a1", True, [], 1)
    f.isl["A"].report("a1", report(a.job_id, [agent(0, 0), agent(1, 1)], resize_epoch=1, resize_port=5555))
    f.beat()
    assert not sent_to(f.isl["A"], p.ResizeJob), "went before B's joiners were warm"
    f.isl["B"].report("b1", report(b.job_id, [agent(2, 0, standby=True), agent(3, 1, standby=True)], resize_epoch=1))
    assert b.state is JobState.STARTING   # its nodes report waiting joiners as running: not up before they join
    f.beat()
    go = p.ResizeJob(job_id=a.job_id, devices=4, epoch=1, master_addr="a1.host", master_port=5555, devices_from=2,
                     blocks=[2, 2, 2, 2], islands=[2, 2])
    assert sent_to(f.isl["A"], p.ResizeJob) == [("a1", go)]
    assert sent_to(f.isl["B"], p.ResizeJob) == [("b1", dataclasses.replace(go, job_id=b.job_id))]
    f.isl["A"].report("a1", report(a.job_id, [agent(0, 0, epoch=1, stepped=1), agent(1, 1, epoch=1, stepped=1)]))
    f.beat()
    assert span.state == "moving"   # B's agents have not stepped yet
    f.isl["B"].report("b1", report(b.job_id, [agent(2, 0, epoch=1, stepped=1), agent(3, 1, epoch=1, stepped=1)]))
    f.beat()
    assert span.state == "running" and "grew live onto island B: 4 agents (move 1)" in span.reason
    (entry,) = a.resizes   # each island's status shows the move as a resize of its portion
    assert (entry.src, entry.dst, entry.outcome, entry.blocks) == (2, 2, "done", [2, 2])
    assert "move 1 of job s1 spanning islands: 2 -> 4 agents in all" in entry.why
    assert [(e.src, e.dst) for e in b.resizes] == [(0, 2)]
    assert b.state is JobState.RUNNING and a.state is JobState.RUNNING
    assert span.restarts == 1 and span.attempt == 2   # the loss's restart only: this was no restart
    assert [(pt.island, pt.spec.world, pt.spec.rank_offset) for pt in span.parts] == [("A", 4, 0), ("B", 4, 2)]
    assert "portion 1 of 2: ranks 0-1 of 4, 4 of its 8 workers" in f.isl["A"].s.status(a.job_id, f.now).jobs[0].portion_of
    info = f.spans.table().spans[0]
    assert [(x.island, x.ranks, x.workers) for x in info.portions] == [("A", "0-1", 4), ("B", "2-3", 4)]
    f.deliver(f.spans.tick(f.now + 100, f.free()))
    assert span.state == "running"   # nothing more to grow onto


def test_a_job_short_of_the_devices_it_asked_for_grows_live_onto_an_island_that_frees_some():
    f = Front({"A": 2, "B": 2, "C": 2})
    local_b, _ = f.isl["B"].submit(workers=2, lo=2, hi=2)   # B and C busy with their own jobs
    local_c, _ = f.isl["C"].submit(workers=2, lo=2, hi=2)
    span, out = f.spans.submit(req(workers=8, islands=(), max_islands=2), "alice", f.now, f.free())
    f.deliver(out)
    f.beat()
    a = f.job("A")
    f.isl["A"].report("a1", report(a.job_id, [agent(0, 0), agent(1, 1)], master_port=4242))
    f.beat()
    assert span.state == "running" and [pt.island for pt in span.parts] == ["A"]
    f.deliver(f.spans.tick(f.now + 1, f.free()))
    assert span.state == "running"   # nothing free to grow onto
    for isl, job in (("B", local_b), ("C", local_c)):
        f.isl[isl].s.stop(job, f.isl[isl].now)
        f.isl[isl].report(f"{isl.lower()}1", report(job, [agent(0, 0, alive=False), agent(1, 1, alive=False)],
                                                     state="ended"))
    assert f.free() == {"A": 0, "B": 2, "C": 2}
    f.deliver(f.spans.tick(f.now + 2, f.free()))
    # up to --max-islands 2: onto one of them, as far as the 8 devices it asked for allow
    assert span.state == "moving" and "growing live onto 2 on B: 2 -> 4 agents" in span.reason
    assert [pt.island for pt in span.parts] == ["A", "B"]


def test_a_live_grow_whose_joiners_fail_is_called_off_the_job_runs_on_and_the_island_is_offered_again():
    f, span, a = on_a_alone()
    b_is_back(f)
    f.deliver(f.spans.tick(f.now + 0.4, f.free()))
    f.beat()
    b = f.job("B")
    f.isl["A"].report("a1", report(a.job_id, [agent(0, 0), agent(1, 1)], resize_epoch=1, resize_port=5555))
    f.isl["B"].report("b1", report(b.job_id, [agent(2, 0, standby=True)], resize_epoch=1,
                                   resize_error={"message": "cannot load /s.py: SyntaxError"}))
    assert b.state is JobState.FAILED
    f.beat()
    assert span.state == "running" and "moving live called off (island B failed its portion" in span.reason
    assert [pt.island for pt in span.parts] == ["A"] and span.restarts == 1
    assert sent_to(f.isl["A"], p.AbortResize) == [("a1", p.AbortResize(job_id=a.job_id, epoch=1, reason=ANY_REASON))]
    assert a.state is JobState.RUNNING and not sent_to(f.isl["A"], p.ResizeJob)
    f.deliver(f.spans.tick(f.now + 30, f.free()))
    assert span.state == "running"   # not offered again at once
    f.deliver(f.spans.tick(f.now + 61, f.free()))
    assert span.state == "moving" and span.move.epoch == 2


def test_a_live_grow_not_ready_in_time_is_called_off_and_one_that_fails_after_the_go_restarts_the_job():
    f, span, a = on_a_alone(reserve_timeout_s=10.0)
    b_is_back(f)
    f.deliver(f.spans.tick(f.now + 0.4, f.free()))
    f.beat()
    f.tick(11.0)   # A picked no port, B's joiners never said hello
    assert span.state == "running" and "island A, B not ready within 10s" in span.reason
    b_old = f.isl["B"].s.jobs[span_job_ids(f, "B")[-1]]
    assert b_old.state is JobState.STOPPED
    f.isl["B"].report("b1", report(b_old.job_id, [agent(2, 0, alive=False, standby=True)], state="ended"))
    f.tick(61.0)
    assert span.state == "moving"
    f.beat()
    b = f.job("B")
    f.isl["A"].report("a1", report(a.job_id, [agent(0, 0), agent(1, 1)], resize_epoch=2, resize_port=5555))
    f.isl["B"].report("b1", report(b.job_id, [agent(2, 0, standby=True), agent(3, 1, standby=True)], resize_epoch=2))
    f.beat()
    assert span.move.went
    f.isl["A"].report("a1", report(a.job_id, [agent(0, 0, alive=False), agent(1, 1)], state="ended", ok=False,
                                   error={"message": "PeerLost: the group re-forming failed", "cause": "peer_lost"}))
    f.beat()
    assert span.state == "recovering" and "PeerLost" in span.reason and span.restarts == 2
    assert b.state is JobState.STOPPED


def span_job_ids(f: Front, island: str) -> list[str]:
    return [j.job_id for j in f.isl[island].s.jobs.values() if j.spec.portion is not None]


class _Any:
    def __eq__(self, other) -> bool:
        return True


ANY_REASON = _Any()


def test_the_script_s_own_failure_fails_the_job_and_so_does_one_past_max_restarts():
    f = Front({"A": 2, "B": 2})
    span, a = started(f, req(workers=8))
    f.isl["A"].report("a1", report(a.job_id, [agent(0, 0, alive=False, exitcode=1), agent(1, 1)], state="ended",
                                   ok=False, error={"message": "ValueError: boom", "cause": "user"}))
    f.beat()
    assert span.state == "failed" and "its portion on island A failed: ValueError: boom" in span.reason
    assert [j.state for j in f.isl["B"].s.jobs.values()] == [JobState.STOPPED]
    f = Front({"A": 2, "B": 2})
    span, a = started(f, req(workers=8).__class__(script="/s.py", workers=8, islands=["A", "B"], max_restarts=0))
    f.deliver(f.spans.island_lost("B", "no status for 11s", f.now))
    assert span.state == "failed" and "not restarting: 0 restart(s) of --max-restarts 0 used" in span.reason
    assert f.spans.stop(span.span_id, f.now)[0] == f"job {span.span_id} already failed"


def test_an_island_that_refuses_its_portion_fails_the_job_releasing_the_others_and_a_stale_reservation_is_cancelled():
    f = Front({"A": 2, "B": 3})
    stale = p.PortionSpec(span_id="s9", attempt=1, index=0, workers=2, world=1, rank_offset=0, blocks=[2], islands=[1])
    f.isl["B"].s.portions.apply(p.ReservePortion(portion=stale, script="/s.py"), f.now)
    span, out = f.spans.submit(req(workers=8, devices=4), "alice", f.now, {"A": 2, "B": 2})
    out[1][1].script = ""   # what B's scheduler refuses
    f.deliver(out)
    f.beat()
    assert f.isl["B"].s.portions.find("s9", 1).state is JobState.STOPPED   # no job of this front's
    assert span.state == "failed" and "island B failed its portion: script path is empty" in span.reason
    assert f.isl["A"].s.jobs[span.parts[0].row.job_id].state is JobState.STOPPED
    assert f.isl["A"].s.free_count() == 2


def test_a_portion_is_not_resized_and_only_the_front_may_command_one():
    isl = Island()
    isl.hello("a1", 2)
    spec = p.PortionSpec(span_id="s1", attempt=1, index=1, workers=8, world=4, rank_offset=2, blocks=[2] * 4,
                         islands=[2, 2])
    isl.s.portions.apply(p.ReservePortion(portion=spec, script="/s.py"), isl.now)
    (job,) = isl.s.jobs.values()
    assert job.state is JobState.RESERVED and job.spec.max_restarts == 0
    with pytest.raises(Exception, match="portion of job s1 spanning islands"):
        isl.s.scale(job.job_id, 1, isl.now)
    isl.now += isl.s.cfg.start_timeout_s + 1   # a front that never starts it: the island lets go
    isl.report("a1")
    isl.tick(0.0)
    assert job.state is JobState.FAILED and "did not start it" in job.error["message"]
    # what a client may send a front: its own jobs spanning islands, not an island's messages
    client = Principal(owner="K", role="client", name="c")
    island = Principal(owner="I", role="island", name="i", node_id="A")
    assert authz.check(client, req()) is None and authz.check(client, p.ListSpans()) is None
    assert authz.check(island, req()) is not None
    assert authz.check(client, p.StartPortion(span_id="s1", attempt=1)) is not None


def running_on_both(f: Front, req_: p.SubmitSpanning):
    span, a = started(f, req_)
    b = f.job("B")
    f.isl["B"].report("b1", report(b.job_id, [agent(2, 0), agent(3, 1)]))
    f.beat()
    assert span.state == "running"
    return span, a, b


def test_a_drain_moves_the_job_off_the_island_s_ranks_live_the_rest_going_on_where_they_are():
    f = Front({"A": 2, "B": 2})
    span, a, b = running_on_both(f, req(workers=8))
    isl = f.isl["A"]
    isl.s.drain("a1", 60.0, isl.now)
    f.tick(1.0)
    assert "waiting for its federation front to move that job off the node" in isl.s.drains.info("a1", isl.now).waiting
    assert isl.s.portions.rows()[0].leaving == [0, 1]
    f.beat()
    f.tick(0.5)   # the front moves the job off ranks 0-1: ranks 2-3 on B stay, as ranks 0-1 of 2
    assert span.state == "moving" and "moving live off 2 device(s) its islands want back: 4 -> 2 agents" in span.reason
    # B hosts the new rank 0 (old rank 2): its node picks the new group's port; A has nothing to prepare
    ((node, prep),) = sent_to(f.isl["B"], p.PrepareResize)
    assert (node, prep.pick_port, prep.joiners, prep.devices_from, prep.devices) == ("b1", True, [], 4, 2)
    assert not sent_to(isl, p.PrepareResize)
    f.isl["B"].report("b1", report(b.job_id, [agent(2, 0), agent(3, 1)], resize_epoch=1, resize_port=6000))
    f.beat()
    # every agent, those that leave too, is told the same new group: they hand their workers over by it
    go = p.ResizeJob(job_id=a.job_id, devices=2, epoch=1, master_addr="b1.host", master_port=6000, devices_from=4,
                     keep=[2, 3], blocks=[4, 4], islands=[2])
    assert sent_to(isl, p.ResizeJob) == [("a1", go)]
    assert sent_to(f.isl["B"], p.ResizeJob) == [("b1", dataclasses.replace(go, job_id=b.job_id))]
    # A's agents hand their workers over and leave; B's re-form as ranks 0-1 and step. A's node names no
    # rank of the job any more (its agents are retired there) and reports no step.
    isl.report("a1", report(a.job_id, [agent(0, 0), agent(1, 1)], step=12))
    left = [agent(0, 0, epoch=1, left=True), agent(1, 1, epoch=1, left=True)]
    isl.report("a1", dataclasses.replace(report(a.job_id, left), ranks=[]))
    f.beat()
    assert span.state == "moving" and a.step == 12
    # they exit 0 at once: A's portion finishes, which is no failure of the job while it moves off A
    gone = [agent(0, 0, alive=False, exitcode=0, left=True), agent(1, 1, alive=False, exitcode=0, left=True)]
    isl.report("a1", dataclasses.replace(report(a.job_id, gone, state="ended"), ranks=[]))
    assert a.state is JobState.FINISHED and a.step == 12   # what it had run, not the step of agents that left
    f.beat()
    assert span.state == "moving"
    f.isl["B"].report("b1", report(b.job_id, [agent(0, 0, epoch=1, stepped=1), agent(1, 1, epoch=1, stepped=1)]))
    f.beat()
    assert span.state == "running" and "moved live off 2 device(s) its islands wanted back, leaving island A: 2 agents" in span.reason
    assert [(pt.island, pt.spec.index, pt.spec.world, pt.spec.rank_offset, pt.spec.blocks) for pt in span.parts] == [
        ("B", 0, 2, 0, [4, 4])]
    assert span.restarts == 0 and not sent_to(isl, p.CancelPortion)
    assert f.job("B").spec.portion.islands == [2] and f.job("B").blocks == [4, 4]
    isl.tick(0.1)
    assert isl.s.drains.info("a1", isl.now).drained   # nothing of the job holds the node any more


def test_a_drain_of_one_node_of_an_island_shrinks_its_portion_there_and_frees_that_device():
    f = Front({"A": 1, "B": 2})
    f.isl["A"].hello("a2", 1)
    span, out = f.spans.submit(req(workers=8), "alice", f.now, f.free())
    f.deliver(out)
    f.beat()
    a = f.job("A")
    assert a.placement == [["a1", "cpu:0"], ["a2", "cpu:0"]]
    f.isl["A"].report("a1", report(a.job_id, [agent(0, 0)], master_port=4242))
    f.beat()
    f.isl["A"].report("a2", report(a.job_id, [agent(1, 0)]))
    b = f.job("B")
    f.isl["B"].report("b1", report(b.job_id, [agent(2, 0), agent(3, 1)]))
    f.beat()
    assert span.state == "running"
    f.isl["A"].s.drain("a2", 60.0, f.isl["A"].now)
    f.tick(1.0)
    f.beat()
    f.tick(0.5)
    assert span.state == "moving" and span.move.keep == [0, 2, 3]
    f.isl["A"].report("a1", report(a.job_id, [agent(0, 0)], resize_epoch=1, resize_port=6001))
    f.beat()
    (_node, go), = sent_to(f.isl["A"], p.ResizeJob)[:1]
    assert (go.keep, go.devices, go.islands, go.blocks) == ([0, 2, 3], 3, [1, 2], [3, 3, 2])
    f.isl["A"].report("a2", report(a.job_id, [agent(1, 0, epoch=1, left=True)]))
    f.isl["A"].report("a1", report(a.job_id, [agent(0, 0, epoch=1, stepped=1)]))
    f.isl["B"].report("b1", report(b.job_id, [agent(1, 0, epoch=1, stepped=1), agent(2, 1, epoch=1, stepped=1)]))
    f.beat()
    assert span.state == "running" and [(pt.island, pt.spec.rank_offset, pt.spec.devices) for pt in span.parts] == [
        ("A", 0, 1), ("B", 1, 2)]
    assert a.state is JobState.RUNNING and a.placement == [["a1", "cpu:0"]] and a.blocks == [3]
    assert f.isl["A"].s.free_count() == 0   # the left agent's device is free once it is gone
    f.isl["A"].report("a2", report(a.job_id, [agent(1, 0, alive=False, exitcode=0, left=True)], state="ended"))
    assert f.isl["A"].s.free_count() == 0   # a2 is draining: it takes no work, but holds nothing of the job
    assert not f.isl["A"].s.jobs[a.job_id].zombies


def test_a_local_job_of_higher_priority_preempts_a_portion_through_its_front_live():
    f = Front({"A": 2, "B": 2})
    span, a, b = running_on_both(f, req(workers=8))
    local, _ = f.isl["A"].submit(workers=1, lo=1, hi=1, prio=5)
    assert f.isl["A"].state(local) is JobState.QUEUED
    f.tick(0.5)
    assert f.isl["A"].s.portions.rows()[0].leaving == [1]   # its last rank, asked back from the front
    f.beat()
    f.tick(0.5)
    assert span.state == "moving" and span.move.keep == [0, 2, 3]
    f.isl["A"].report("a1", report(a.job_id, [agent(0, 0), agent(1, 1)], resize_epoch=1, resize_port=6002))
    f.beat()
    f.isl["A"].report("a1", report(a.job_id, [agent(0, 0, epoch=1, stepped=1), agent(1, 1, epoch=1, left=True)]))
    f.isl["B"].report("b1", report(b.job_id, [agent(1, 0, epoch=1, stepped=1), agent(2, 1, epoch=1, stepped=1)]))
    f.beat()
    assert span.state == "running" and [(pt.island, pt.spec.devices) for pt in span.parts] == [("A", 1), ("B", 2)]
    assert f.isl["A"].state(local) is JobState.QUEUED   # the device is free once the agent that left is gone
    f.isl["A"].report("a1", report(a.job_id, [agent(0, 0, epoch=1, stepped=1), agent(1, 1, alive=False, left=True)]))
    f.isl["A"].tick(0.1)
    assert f.isl["A"].state(local) is JobState.STARTING
    assert f.isl["A"].s.portions.rows()[0].leaving == []


def test_a_move_its_agents_refuse_is_called_off_on_every_island_and_the_job_trains_on_as_it_was():
    f = Front({"A": 2, "B": 2})
    span, a, b = running_on_both(f, req(workers=8))
    f.isl["A"].s.drain("a1", 60.0, f.isl["A"].now)
    f.tick(1.0)
    f.beat()
    f.tick(0.5)
    f.isl["B"].report("b1", report(b.job_id, [agent(2, 0), agent(3, 1)], resize_epoch=1, resize_port=6000))
    f.beat()
    assert span.move.went
    # at the step boundary the agents find a state they cannot carry: each node says so
    refusal = {"message": "a generator in flight", "refused": True, "step": 7}
    f.isl["A"].report("a1", report(a.job_id, [agent(0, 0), agent(1, 1)], resize_epoch=1, resize_error=refusal))
    f.beat()
    assert span.state == "running" and "moving live called off (island A: a generator in flight)" in span.reason
    assert [pt.island for pt in span.parts] == ["A", "B"] and span.parts[1].spec.rank_offset == 2
    for isl, job in (("A", a), ("B", b)):   # B's nodes too: its agents refused as well, and it went
        assert [m.epoch for _n, m in sent_to(f.isl[isl], p.AbortResize)] == [1], isl
        assert job.state is JobState.RUNNING and job.spec.portion.world == 4
    assert span.restarts == 0 and span.move_at > f.now


def test_a_portion_s_last_device_is_preempted_too_the_job_moving_off_its_island():
    f = Front({"A": 1, "B": 2})
    span, out = f.spans.submit(req(workers=8), "alice", f.now, f.free())
    f.deliver(out)
    f.beat()
    a = f.job("A")
    f.isl["A"].report("a1", report(a.job_id, [agent(0, 0)], master_port=4242))
    f.beat()
    b = f.job("B")
    f.isl["B"].report("b1", report(b.job_id, [agent(1, 0), agent(2, 1)]))
    f.beat()
    assert span.state == "running" and [pt.spec.devices for pt in span.parts] == [1, 2]
    local, _ = f.isl["A"].submit(workers=1, lo=1, hi=1, prio=5)
    f.tick(0.5)
    assert f.isl["A"].s.portions.rows()[0].leaving == [0]
    f.beat()
    f.tick(0.5)
    assert span.state == "moving" and span.move.keep == [1, 2] and span.move.index == [-1, 0]


def test_a_drain_of_every_rank_waits_and_at_its_deadline_the_front_restarts_the_job():
    f = Front({"A": 2, "B": 2})
    span, a, b = running_on_both(f, req(workers=8))
    f.isl["A"].s.drain("a1", 5.0, f.isl["A"].now)
    f.isl["B"].s.drain("b1", 5.0, f.isl["B"].now)
    f.tick(1.0)
    f.beat()
    f.tick(1.0)
    assert span.state == "running" and not sent_to(f.isl["A"], p.PrepareResize)   # nowhere to move to
    f.tick(5.0)   # the deadline: the portions fail (drained), which the front restarts the job after
    assert a.state is JobState.FAILED and a.error["cause"] == "drained"
    f.beat()
    assert span.state == "recovering" and "drained" in span.reason


def test_a_restart_waits_for_the_portions_to_end_but_not_past_the_reservation_timeout():
    f = Front({"A": 2, "B": 2}, reserve_timeout_s=10.0)
    span, a = started(f, req(workers=8))
    f.isl["A"].report("a1", report(a.job_id, [agent(0, 0, alive=False), agent(1, 1)], state="ended", ok=False,
                                   error={"message": "PeerLost: another agent's connection closed", "cause": "peer_lost"}))
    f.beat()
    assert span.state == "recovering" and "PeerLost" in span.reason
    stale = p.PortionRow(span_id=span.span_id, attempt=span.attempt, index=1, job_id="j1", state="running")
    f.spans.rows("B", [stale], f.now)   # B's scheduler lost track of its portion: it shows it running for good
    f.deliver(f.spans.tick(f.now + 5.0, {"A": 2, "B": 2}))
    assert span.state == "recovering"
    f.deliver(f.spans.tick(f.now + 11.0, {"A": 2, "B": 2}))
    assert span.state == "reserving" and span.attempt == 2


def test_the_front_s_events_tell_each_job_s_states_and_each_island_s_comings_and_goings():
    from elasticd.federation import events
    from elasticd.federation.state import FederationState

    fed = FederationState(timeout_s=5.0)
    fed.hello(p.IslandHello(island_id="A", capacity=p.IslandCapacity(devices=2, free=2)), 90.0)
    fed.tick(96.0)
    fed.hello(p.IslandHello(island_id="A", capacity=p.IslandCapacity(devices=2, free=2)), 97.0)
    f = Front({"A": 2, "B": 2})
    span, _a = started(f, req(workers=8))
    evs, more = events.select([(span.span_id, span.history)], fed.events)
    assert not more
    assert [(e.event, e.job or e.island) for e in evs] == [
        ("island_joined", "A"), ("island_lost", "A"), ("island_back", "A"),
        ("submitted", "s1"), ("reserving", "s1"), ("starting", "s1")]
    assert [e.event for e in events.select([(span.span_id, span.history)], fed.events, after=96.5)[0]] == [
        "island_back", "submitted", "reserving", "starting"]


def test_the_front_keeps_a_bounded_table_and_counts_each_key_s_jobs(monkeypatch):
    from elasticd.federation import spans as spans_mod

    monkeypatch.setattr(spans_mod, "KEEP_ENDED", 2)
    s = Spans()
    for _ in range(4):
        span, _out = s.submit(req(), "alice", 1.0, {})
        assert span.state == "waiting" and "island A, B are not up" in span.reason
    assert s.active("alice") == 4 and s.active("bob") == 0
    for span_id in ("s1", "s2", "s3"):
        s.stop(span_id, 2.0)
    s.tick(3.0, {})
    assert sorted(s.spans) == ["s2", "s3", "s4"] and s.active("alice") == 1


def test_a_portion_whose_node_is_lost_while_starting_fails_for_the_front_to_restart_not_requeued():
    f = Front({"A": 2, "B": 2})
    span, _a = started(f, req(workers=8))
    b = f.job("B")
    assert b.state is JobState.STARTING
    f.isl["B"].tick(11.0)   # b1 silent past the node timeout
    assert b.state is JobState.FAILED and b.error["cause"] == "node_lost"
    f.beat()
    assert span.state == "recovering" and "node b1 lost" in span.reason


def test_agents_on_an_island_of_faster_devices_host_more_workers_and_islands_report_their_speed():
    from elasticd.scheduler.federation_link import capacity

    s = split(req(workers=12), {"A": 2, "B": 2}, speed={"A": 4.0, "B": 2.0})   # A's devices twice as fast
    assert (s.devices, s.blocks) == ((2, 2), (4, 4, 2, 2))
    assert split(req(workers=12), {"A": 2, "B": 2}, speed={"A": 2.0, "B": 2.0}).blocks == (3, 3, 3, 3)
    assert split(req(workers=12), {"A": 2, "B": 2}, speed={"A": 4.0}).blocks == (3, 3, 3, 3)   # B's unknown
    assert split(req(workers=12), {"A": 2, "B": 2}, speed={"A": 4.0, "B": 2.0}).portion("s1", 1, 1, 12).own_blocks == [2, 2]
    isl = Island()
    devs = [p.DeviceInfo(device_id=f"cpu:{i}", type="cpu", index=i, speed=0.5) for i in range(3)]
    isl.s.node_hello(p.NodeHello(node_id="b1", host="h", devices=devs), isl.now)
    assert capacity(isl.s).free_speed == 1.5 and capacity(isl.s).free == 3


def test_a_reservation_its_island_stops_releases_the_others_and_the_job_waits_to_try_again():
    f = Front({"A": 2, "B": 2})
    f.isl["B"].submit(workers=2, lo=2, hi=2)   # B is full: A holds its portion, B's waits in B's queue
    span, out = f.spans.submit(req(workers=8), "alice", f.now, {"A": 2, "B": 2})
    f.deliver(out)
    a = f.job("A")
    f.isl["A"].s.stop(a.job_id, f.now)   # A's admin stops it
    f.beat()
    assert span.state == "waiting" and "island A stopped its portion" in span.reason
    assert [j.state for j in f.isl["B"].s.jobs.values() if j.spec.portion is not None] == [JobState.STOPPED]


def test_a_job_read_back_from_disk_is_the_one_written_and_one_caught_moving_restarts_from_its_snapshot():
    import json

    from elasticd.federation.spans import Span

    f = Front({"A": 2, "B": 2})
    span, a, b = running_on_both(f, req(workers=8))
    doc = json.loads(json.dumps(span.to_doc()))   # as the front's table stores it
    back = Span.from_doc(doc, f.now, 30.0)
    assert back.info() == dataclasses.replace(span.info(), portions=[
        dataclasses.replace(pt, job_id="", state="", step=0, error="") for pt in span.info().portions])
    assert [pt.spec for pt in back.parts] == [pt.spec for pt in span.parts] and back.key == span.key
    spans = Spans()
    spans.load([doc, {"span_id": "s9", "seq": 9}], f.now)   # a row it cannot read is skipped
    assert list(spans.spans) == [span.span_id]
    f.isl["A"].s.drain("a1", 60.0, f.isl["A"].now)
    f.tick(1.0)
    f.beat()
    f.tick(0.5)
    assert span.state == "moving"
    moving = Span.from_doc(json.loads(json.dumps(span.to_doc())), f.now, 30.0)
    assert moving.state == "recovering" and moving.restore and moving.restarts == 0
    assert "the front restarted during a live move" in moving.reason and moving.changed
