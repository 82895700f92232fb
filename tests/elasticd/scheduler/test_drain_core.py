"""Draining, in the pure parts: the moves of a shrink that keeps any subset of the agents, the node daemon's
renumbering of its agents, and the scheduler's drain decisions (fake clock, nodes played by hand).
The same drain through real processes is tests/elasticd/daemon/test_drain_daemon.py."""

from __future__ import annotations

import itertools

import pytest
from island_core import Island, agent, kills, launches, of, rep, report, resized
from node_core import T0, Node, running

from elasticd import protocol as p
from elasticd.agent.resize.moves import plan_moves, plan_relayout
from elasticd.core.layout import Layout, hosted_ranks, owner_of
from elasticd.resize_plan import ResizePlan
from elasticd.scheduler.jobs import JobState
from elasticd.scheduler.state import SchedulerError

# --- moves (agent/resize/moves.py) -------------------------------------------------------------------


def keeps(max_workers: int = 6):
    for n in range(1, max_workers + 1):
        for old in range(2, n + 1):
            for k in range(1, old):
                for keep in itertools.permutations(range(old), k):
                    yield n, old, list(keep)


def test_every_stayer_ends_with_exactly_the_ranks_of_its_new_place():
    for n, old, keep in keeps():   # every layout of up to 6 ranks, every subset and order of stayers
        moves = plan_relayout(Layout.of(n, old), Layout.of(n, len(keep)), keep)
        assert [m.rank for m in moves] == sorted({m.rank for m in moves}), "one move per rank, in rank order"
        for new_rank, me in enumerate(keep):
            kept = {r for r in hosted_ranks(n, old, me) if owner_of(n, len(keep), r) == new_rank}
            got = {m.rank for m in moves if m.dst == me}
            assert kept | got == set(hosted_ranks(n, len(keep), new_rank)) and not kept & got, (n, old, keep)
        assert all(m.dst in keep and m.src == owner_of(n, old, m.rank) for m in moves)


def test_keeping_the_first_agents_is_the_ordinary_shrink():
    for n, old, new in ((8, 4, 2), (4, 2, 1), (7, 3, 2)):
        assert plan_relayout(Layout.of(n, old), Layout.of(n, new), list(range(new))) == plan_moves(Layout.of(n, old),
                                                                                            Layout.of(n, new))


def test_keeping_agent_1_of_2_moves_the_ranks_of_agent_0_to_it():
    assert [(m.rank, m.src, m.dst) for m in plan_relayout(Layout.of(4, 2), Layout.of(4, 1), [1])] == [(0, 0, 1), (1, 0, 1)]
    with pytest.raises(ValueError):
        plan_relayout(Layout.of(4, 2), Layout.of(4, 1), [])
    with pytest.raises(ValueError):
        plan_relayout(Layout.of(4, 2), Layout.of(4, 2), [1, 1])


def test_a_plan_keeps_only_a_shrink_of_the_old_ranks():
    plan = ResizePlan.begin(epoch=1, src=3, dst=2, why="drain", now=0.0, placement=[["b", "0"], ["c", "0"]],
                            step=0, timeout_s=10.0, keep=[1, 2])
    assert plan.stayers == [1, 2] and plan.leavers == [0] and plan.joiners == []
    prefix = ResizePlan.begin(epoch=1, src=3, dst=2, why="x", now=0.0, placement=[["a", "0"], ["b", "0"]],
                              step=0, timeout_s=10.0, keep=[0, 1])
    assert prefix.keep == [] and prefix.leavers == [2]   # the ordinary shrink, as before
    for bad in ([0], [0, 3], [1, 1]):
        with pytest.raises(ValueError):
            ResizePlan.begin(epoch=1, src=3, dst=2, why="x", now=0.0, placement=[["a", "0"]] * 2, step=0,
                             timeout_s=10.0, keep=bad)


# --- the node daemon (elasticd/daemon) -------------------------------------------------------------


def test_a_shrink_keeping_ranks_renumbers_the_stayers_and_retires_the_others():
    node = Node()
    idents = running(node, ranks=3)
    go = node.core.go(p.ResizeJob(job_id="j", devices=2, epoch=1, master_addr="h", master_port=1, devices_from=3,
                                  keep=[2, 1]))
    assert [a.identity for a in go] == idents and all(a.msg.keep == [2, 1] for a in go)
    r = node.report("j")
    assert r.ranks == [0, 1] and {a.pid: a.rank for a in r.agents} == {
        node.pid["j", 2]: 0, node.pid["j", 1]: 1, node.pid["j", 0]: 0}
    # until it re-formed an agent still speaks as its old rank; then as its new one only
    err, _ = node.core.agent_message(idents[2], p.AgentStep(job_id="j", rank=2, step=5), T0)
    assert err is None
    err, _ = node.core.agent_message(idents[2], p.AgentResized(job_id="j", rank=2, info=p.ResizedInfo(
                                         epoch=1, world=2, rank=0, left=False, seconds=0.1, blocks="")),
                                     T0)
    assert err is None
    err, _ = node.core.agent_message(idents[2], p.AgentStep(job_id="j", rank=2, step=6), T0)
    assert err is not None and "agent 0" in err
    assert node.core.agent_message(idents[2], p.AgentStep(job_id="j", rank=0, step=6), T0)[0] is None
    node.core.agent_message(idents[0], p.AgentResized(job_id="j", rank=0, info=p.ResizedInfo(
        epoch=1, world=2, rank=0, left=True, seconds=0.1, blocks="")), T0)
    assert node.exit("j", 0, 0) == []
    r = node.report("j")
    assert r.state == "running" and r.error is None and r.step == 6 and r.ranks == [0, 1]


# --- the scheduler (elasticd/scheduler/draining.py) ----------------------------------------------


def spanning_job(isl: Island, lo: int = 1, workers: int = 4) -> tuple[str, str, str]:
    """A job on nodes a and b (one device each): (job, node of rank 0, the other node)."""
    isl.hello("a", 1)
    isl.hello("b", 1)
    job, out = isl.submit(workers=workers, lo=lo, hi=2)
    ((lead, _),) = launches(out)
    other = "b" if lead == "a" else "a"
    isl.report(lead, report(job, [agent(0, 0)], master_port=99))
    isl.report(other, report(job, [agent(1, 0)]))
    assert isl.state(job) is JobState.RUNNING
    return job, lead, other


def test_draining_the_node_of_rank_0_shrinks_onto_the_other_which_picks_the_port_and_becomes_rank_0():
    isl = Island()
    job, lead, other = spanning_job(isl)
    text, out = isl.s.drain(lead, 60.0, isl.now)
    isl._take(out)
    assert f"node {lead} draining" in text and job in text
    ((node, prep),) = of(out, p.PrepareResize)
    assert node == other and prep.pick_port and (prep.devices_from, prep.devices) == (2, 1)
    plan = isl.s.jobs[job].resize
    assert plan.keep == [1] and plan.placement == [[other, "cpu:0"]] and plan.why == f"drain of node {lead}"
    out = isl.report(other, report(job, [agent(1, 0)], resize_epoch=1, resize_port=777))
    gos = of(out, p.ResizeJob)
    assert sorted(n for n, _ in gos) == ["a", "b"]
    assert all((g.keep, g.devices, g.master_addr, g.master_port) == ([1], 1, f"{other}.host", 777) for _, g in gos)
    info = isl.s.status(None, isl.now).nodes
    assert next(n for n in info if n.node_id == lead).draining.drained is False
    # the other node's agent, renumbered 0, re-forms and steps; the leaving one exits
    isl.report(lead, report(job, [agent(0, 0, epoch=1, left=True)], resize_epoch=1))
    isl.report(other, report(job, [agent(0, 0, epoch=1, stepped=1)], resize_epoch=1,
                             resizes=[resized(epoch=1, seconds=0.3, step=7)]))
    j = isl.s.jobs[job]
    assert j.state is JobState.RUNNING and j.placement == [[other, "cpu:0"]] and j.master_addr == f"{other}.host"
    assert j.resizes[-1].outcome == "done" and j.resizes[-1].step == 7
    isl.report(lead, report(job, [], state="ended"))
    isl.tick(0.5)
    (row,) = [n for n in isl.s.status(None, isl.now).nodes if n.node_id == lead]
    assert row.draining.drained and row.draining.seconds == pytest.approx(0.5)


def test_a_move_its_agents_refuse_is_not_asked_again_and_the_drain_waits_saying_why():
    isl = Island()
    job, lead, other = spanning_job(isl)
    isl._take(isl.s.drain(lead, 60.0, isl.now)[1])
    isl.report(other, report(job, [agent(1, 0)], resize_epoch=1, resize_port=777))
    why = "logical rank 0: cannot carry `warmup` in train() across the resize"
    out = isl.report(lead, report(job, [agent(0, 0)], resize_epoch=1,
                                  resize_error={"message": why, "refused": True, "step": 9}))
    assert sorted(n for n, _ in of(out, p.AbortResize)) == ["a", "b"]
    j = isl.s.jobs[job]
    assert j.state is JobState.RUNNING and len(j.placement) == 2 and j.resizes[-1].outcome == "refused"
    out = isl.tick(1.0)
    assert of(out, p.PrepareResize) == [] and j.resize is None   # not asked again
    assert f"{job}: its agents refused to move it: {why}" in isl.s.drains.info(lead, isl.now).waiting


def test_a_draining_node_takes_no_new_job_until_undrained():
    isl = Island()
    isl.hello("a", 2)
    isl.s.drain("a", None, isl.now)
    isl.s.tick(isl.now)   # nothing runs there: drained at once
    job, out = isl.submit(workers=1)
    assert launches(out) == [] and isl.state(job) is JobState.QUEUED
    assert isl.s.status(None, isl.now).nodes[0].draining.deadline_s is None
    text, out = isl.s.undrain("a", isl.now)
    assert "back in service" in text and launches(isl._take(out))[0][0] == "a"
    node_events = [e.event for e in isl.s.events(None, 0.0).events if e.node == "a"]
    assert node_events == ["node_joined", "node_draining", "node_drained", "node_undrained"]   # `elasticd events`
    with pytest.raises(SchedulerError) as e:
        isl.s.undrain("a", isl.now)
    assert e.value.code == p.INVALID_STATE
    with pytest.raises(SchedulerError) as e:
        isl.s.drain("zz", 1.0, isl.now)
    assert e.value.code == p.UNKNOWN_NODE and "up: a" in e.value.message


def test_a_job_wholly_on_the_draining_node_grows_elsewhere_first_then_shrinks_off():
    isl = Island()
    isl.hello("a", 2)
    job, out = isl.submit(workers=4, lo=2, hi=2)
    isl.report("a", report(job, [agent(0, 0), agent(1, 1)], master_port=9))
    isl.hello("b", 2)
    _, out = isl.s.drain("a", 60.0, isl.now)
    isl._take(out)
    plan = isl.s.jobs[job].resize
    assert (plan.src, plan.dst, plan.keep) == (2, 4, []) and plan.nodes() == ["a", "b"]
    assert plan.why == "drain of node a: growing onto other nodes first"
    j = isl.s.jobs[job]   # play the grow to its end
    isl.report("a", report(job, [agent(0, 0), agent(1, 1)], resize_epoch=1, resize_port=5))
    out = isl.report("b", report(job, [agent(2, 0, standby=True), agent(3, 1, standby=True)], resize_epoch=1))
    assert of(out, p.ResizeJob)
    isl.report("b", report(job, [agent(2, 0, epoch=1), agent(3, 1, epoch=1)], resize_epoch=1))
    out = isl.report("a", report(job, [agent(0, 0, epoch=1, stepped=1), agent(1, 1, epoch=1)], resize_epoch=1))
    assert j.resize is None and len(j.placement) == 4
    out = isl.tick(0.5)   # the next tick moves it off a, keeping ranks 2 and 3
    assert j.resize is not None and j.resize.keep == [2, 3] and j.resize.placement == [["b", "cpu:0"], ["b", "cpu:1"]]
    assert [n for n, prep in of(out, p.PrepareResize) if prep.pick_port] == ["b"]


def test_a_job_that_cannot_move_waits_saying_why_and_is_recovered_at_the_deadline_naming_the_drain():
    isl = Island()
    job, lead, other = spanning_job(isl, lo=2, workers=2)
    isl._take(isl.s.drain(other, 5.0, isl.now)[1])
    assert isl.s.jobs[job].resize is None
    isl.tick(1.0)
    waiting = isl.s.drains.info(other, isl.now).waiting
    assert job in waiting and "--min-devices 2" in waiting
    out = isl.tick(4.5)
    j = isl.s.jobs[job]
    # Stopped to restart from its snapshot, as after a lost node (elasticd.scheduler.recovery).
    assert j.state is JobState.RECOVERING and j.recovery.error["drain"] is True
    assert f"node {other} was drained and its deadline passed" in j.recovery.cause
    assert sorted(kills(out)) == sorted([(lead, job), (other, job)])
    assert not isl.s.drains.info(other, isl.now).drained   # its agents are not gone yet
    isl.report(other, rep(job, "ended", (1,), ok=False))
    isl.report(lead, rep(job, "ended", (0,), ok=False))
    isl.tick(0.5)
    assert isl.s.drains.info(other, isl.now).drained
    # One device left off the drained node, --min-devices 2: it waits in the queue to restart from its snapshot.
    assert j.state is JobState.QUEUED and j.restore_latest and j.placement == []


def test_a_node_that_leaves_ends_its_drain_and_comes_back_in_service():
    isl = Island()
    isl.hello("a", 1)
    isl.s.drain("a", 10.0, isl.now)
    isl._take(isl.s.node_bye("a", isl.now))
    isl.tick(0.5)
    assert not isl.s.drains.holds("a")
    with pytest.raises(SchedulerError):   # a node that is not up cannot be drained
        isl.s.drain("a", 10.0, isl.now)
    isl.hello("a", 1)
    job, out = isl.submit(workers=1)
    assert launches(out)[0][0] == "a"


def test_sigterm_grace_drains_until_the_scheduler_says_drained_or_the_deadline():
    from elasticd.daemon.grace import GraceDrain

    assert GraceDrain(0.0).terminate(T0)   # no grace: exit at once
    g = GraceDrain(30.0)
    assert not g.terminate(T0) and g.draining and g.left(T0 + 10) == 20.0
    assert g.must_ask(connected=True) and not g.must_ask(connected=True)   # asked once
    assert not g.done(T0 + 1, live_agents=0, connected=True)   # agents gone, but the job's move not complete
    g.drained = True
    assert not g.done(T0 + 1, live_agents=1, connected=True) and g.done(T0 + 1, live_agents=0, connected=True)
    late = GraceDrain(30.0)
    late.terminate(T0)
    assert not late.done(T0 + 29, 2, True) and late.done(T0 + 30, 2, True)
    assert not late.done(T0 + 1, 0, True) and late.done(T0 + 1, 0, connected=False)
    assert late.terminate(T0 + 2)   # a second SIGTERM exits at once
