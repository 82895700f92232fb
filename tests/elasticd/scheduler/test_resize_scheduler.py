"""Live resize and policy-driven elasticity in the scheduler's state machine, driven by hand (fake clock,
no sockets): the messages it sends at each step, what it records, how it fails."""

from __future__ import annotations

import pytest
from island_core import Island, agent, complete, kills, launches, of, report, resized, running_job

from elasticd import protocol as p
from elasticd.cli.status import render_job
from elasticd.core.records import ResizeEntry
from elasticd.scheduler.jobs import Job, JobState
from elasticd.scheduler.state import SchedulerError


def test_shrink_prepares_port_goes_completes_on_first_step_and_frees_devices_of_ranks_that_left():
    isl = Island()
    isl.hello("a", 4)
    job = running_job(isl)
    msg, out = isl.s.scale(job, 2, isl.now)
    assert "4 -> 2" in msg and isl.state(job) is JobState.RESIZING
    ((node, prep),) = of(out, p.PrepareResize)
    assert node == "a" and prep.pick_port and prep.joiners == [] and (prep.devices_from, prep.devices) == (4, 2)
    with pytest.raises(SchedulerError) as e:   # one resize at a time
        isl.s.scale(job, 1, isl.now)
    assert e.value.code == p.INVALID_STATE
    # the port arrives in a heartbeat: no joiners to wait for, so every agent is told at once
    out = isl.report("a", report(job, [agent(r, r) for r in range(4)], resize_epoch=1, resize_port=777))
    ((_, go),) = of(out, p.ResizeJob)
    assert (go.devices, go.devices_from, go.epoch, go.master_addr, go.master_port) == (2, 4, 1, "a.host", 777)
    isl.now += 0.5
    acked = [agent(0, 0, epoch=1), agent(1, 1, epoch=1), agent(2, 2, epoch=1, left=True),
             agent(3, 3, epoch=1, left=True)]
    isl.report("a", report(job, acked, resize_epoch=1))
    assert isl.state(job) is JobState.RESIZING   # rank 0 has not stepped at the new size yet
    acked[0] = agent(0, 0, epoch=1, stepped=1)
    isl.now += 0.25
    isl.report("a", report(job, acked, resize_epoch=1, resizes=[resized(epoch=1, seconds=0.2)]))
    j = isl.s.jobs[job]
    assert j.state is JobState.RUNNING and j.placement == [["a", "cpu:0"], ["a", "cpu:1"]]
    (entry,) = j.resizes
    assert entry.src == 4 and entry.dst == 2 and entry.why == "scale command"
    assert entry.outcome == "done" and entry.seconds == pytest.approx(0.75) and entry.handover_s == 0.2
    # devices of the ranks that left stay taken until their agents are gone
    assert isl.s.free_count() == 0
    isl.report("a", report(job, acked[:2] + [agent(3, 3, epoch=1, left=True)]))
    assert isl.s.free_count() == 1
    isl.report("a", report(job, acked[:2]))
    assert isl.s.free_count() == 2
    assert isl.s.status(job, isl.now).jobs[0].resizes == j.resizes


def test_grow_onto_another_node_waits_for_warm_joiners_then_goes_everywhere():
    isl = Island()
    isl.hello("a", 2)
    job = running_job(isl, devices=2, hi=2)
    isl.hello("b", 2)
    first, other = "a", "b"
    _, out = isl.s.scale(job, 4, isl.now)
    isl._take(out)
    preps = dict(of(out, p.PrepareResize))
    assert preps[first].pick_port and preps[first].joiners == []
    assert [(pl.rank, pl.device_id) for pl in preps[other].joiners] == [(2, "cpu:0"), (3, "cpu:1")]
    assert preps[other].script == "/s.py" and preps[other].workers == 4 and not preps[other].pick_port
    assert isl.s.free_count() == 0   # reserved for the joiners
    out = isl.report(first, report(job, [agent(0, 0), agent(1, 1)], resize_epoch=1, resize_port=99))
    assert of(out, p.ResizeJob) == []   # joiners not warm yet
    out = isl.report(other, report(job, [agent(2, 0, standby=True), agent(3, 1, standby=True)], resize_epoch=1))
    goes = dict(of(out, p.ResizeJob))
    assert sorted(goes) == ["a", "b"] and goes[other].master_addr == f"{first}.host" and goes[other].master_port == 99
    isl.report(other, report(job, [agent(2, 0, epoch=1), agent(3, 1, epoch=1)], resize_epoch=1))
    isl.report(first, report(job, [agent(0, 0, epoch=1, stepped=1), agent(1, 1, epoch=1)], resize_epoch=1))
    j = isl.s.jobs[job]
    assert j.state is JobState.RUNNING and len(j.placement) == 4 and set(j.nodes) == {"a", "b"}
    # finishing needs both nodes now
    isl.report(first, report(job, [agent(0, 0, False), agent(1, 1, False)], state="ended"))
    assert isl.state(job) is JobState.RESIZING or isl.state(job) is JobState.RUNNING
    isl.report(other, report(job, [agent(2, 0, False), agent(3, 1, False)], state="ended"))
    assert isl.state(job) is JobState.FINISHED


def test_a_joiner_dying_before_the_hand_over_calls_the_resize_off_and_the_job_goes_on():
    isl = Island()
    isl.hello("a", 4)
    job = running_job(isl, devices=2)
    _, out = isl.s.scale(job, 4, isl.now)
    out = isl.report("a", report(job, [agent(0, 0), agent(1, 1), agent(2, 2, standby=True), agent(3, 3, False)],
                                 resize_epoch=1, resize_port=5,
                                 resize_error={"message": "ImportError: no module named x", "rank": 3}))
    ((_, abort),) = of(out, p.AbortResize)
    assert abort.epoch == 1 and "ImportError" in abort.reason
    j = isl.s.jobs[job]
    assert j.state is JobState.RUNNING and len(j.placement) == 2 and j.requested_devices == 2
    assert j.resizes[-1].outcome == "aborted" and "ImportError" in j.resizes[-1].note
    assert type(j.resizes[-1]) is ResizeEntry   # elasticd run's record
    isl.report("a", report(job, [agent(0, 0), agent(1, 1), agent(2, 2, standby=True)]))
    assert isl.s.free_count() == 1   # rank 2's joiner is still exiting
    isl.report("a", report(job, [agent(0, 0), agent(1, 1)]))
    assert isl.s.free_count() == 2


def test_a_grow_across_nodes_its_agents_refuse_is_undone_on_every_node_and_the_job_keeps_its_layout():
    isl = Island()
    isl.hello("a", 2)
    job = running_job(isl, devices=2, hi=2)
    isl.hello("b", 2)
    _, out = isl.s.scale(job, 4, isl.now)
    isl._take(out)
    isl.report("a", report(job, [agent(0, 0), agent(1, 1)], resize_epoch=1, resize_port=99))
    out = isl.report("b", report(job, [agent(2, 0, standby=True), agent(3, 1, standby=True)], resize_epoch=1))
    assert sorted(node for node, _ in of(out, p.ResizeJob)) == ["a", "b"]
    why = "logical rank 1: cannot carry `warmup` in train() across the resize"
    refusal = {"message": why, "refused": True, "step": 12}
    stale = isl.report("a", report(job, [agent(0, 0), agent(1, 1)], resize_epoch=0, resize_error=refusal))
    assert of(stale, p.AbortResize) == [] and isl.state(job) is JobState.RESIZING   # another resize's
    out = isl.report("a", report(job, [agent(0, 0), agent(1, 1)], resize_epoch=1, resize_error=refusal))
    aborts = of(out, p.AbortResize)
    assert sorted(node for node, _ in aborts) == ["a", "b"] and all(m.epoch == 1 and m.reason == why for _, m in aborts)
    j = isl.s.jobs[job]
    assert j.state is JobState.RUNNING and j.placement == [["a", "cpu:0"], ["a", "cpu:1"]] and j.resize is None
    assert j.requested_devices == 2   # the policy does not ask again and again
    entry = j.resizes[-1]
    assert (entry.src, entry.dst, entry.outcome, entry.note) == (2, 4, "refused", why)
    assert "refused by its agents" in j.history[-1][2]
    again = isl.report("a", report(job, [agent(0, 0), agent(1, 1)], resize_epoch=1, resize_error=refusal))
    assert of(again, p.AbortResize) == [] and isl.state(job) is JobState.RUNNING
    isl.report("b", report(job, [], state="ended"))
    assert isl.s.free_count() == 2   # the joiners' devices, once they are gone


def test_an_agent_dying_while_the_group_re_forms_without_a_whole_snapshot_fails_the_job_naming_the_resize():
    isl = Island()
    isl.hello("a", 4)
    job = running_job(isl)
    isl.s.scale(job, 2, isl.now)
    isl.report("a", report(job, [agent(r, r) for r in range(4)], resize_epoch=1, resize_port=5))
    # agents 0, 1 saved their parts (and agent 0 the replicated state); agent 2 died before saving
    isl.report("a", report(job, [agent(r, r, alive=False) for r in range(4)], state="ended", ok=False,
                           error={"message": "agent 2 exited with code -9 and left no error report"},
                           snapshot_epoch=1, snapshot_parts=[-1, 0, 1]))
    j = isl.s.jobs[job]
    assert j.state is JobState.FAILED and j.resize is None
    assert j.error["message"].startswith("resize 1 (4 -> 2 devices, scale command) failed: agent 2 exited")
    assert "no complete snapshot to fall back to: its snapshot lacks logical rank(s) [2, 3]" in j.error["message"]
    assert j.resizes[-1].outcome == "failed"
    assert isl.s.free_count() == 4


def growing_onto_node_b(isl: Island) -> str:
    """A job on node a's 2 devices, growing onto node b's 2: its joiners are warm and every agent told."""
    isl.hello("a", 2)
    job = running_job(isl, devices=2, lo=2, hi=2)
    isl.hello("b", 2)
    isl.s.scale(job, 4, isl.now)
    isl.report("a", report(job, [agent(0, 0), agent(1, 1)], resize_epoch=1, resize_port=5))
    out = isl.report("b", report(job, [agent(2, 0, standby=True), agent(3, 1, standby=True)], resize_epoch=1))
    assert of(out, p.ResizeJob) and isl.s.jobs[job].resize.phase == "go"
    return job


def test_an_agent_dying_while_the_group_re_forms_restarts_the_job_on_its_devices_from_the_snapshot():
    isl = Island(node_timeout_s=1e9)
    job = growing_onto_node_b(isl)
    # a joiner dies mid hand-over; a's agents are stuck in the rendezvous: stopped at once, no stop command
    out = isl.report("b", report(job, [agent(2, 0, alive=False), agent(3, 1, alive=False)], state="ended",
                                 ok=False, error={"message": "agent 3 exited with code -9"}))
    ((node, kill),) = of(out, p.KillJob)
    assert node == "a" and kill.force
    j = isl.s.jobs[job]
    assert j.state is JobState.RESIZING and j.resize.phase == "rollback"
    out = isl.report("a", report(job, [agent(0, 0), agent(1, 1)], resize_epoch=1, snapshot_epoch=1,
                                 snapshot_parts=[-1, 0, 1, 2, 3]))
    assert isl.state(job) is JobState.RESIZING   # still waiting for a's agents to be gone
    out = isl.report("a", report(job, [agent(0, 0, alive=False), agent(1, 1, alive=False)], state="ended",
                                 ok=False, error={"message": "killed"}, snapshot_epoch=1,
                                 snapshot_parts=[-1, 0, 1, 2, 3]))
    ((node, launch),) = launches(out)
    assert node == "a" and launch.restore_epoch == 1 and launch.devices == 2
    assert [pl.device_id for pl in launch.placements] == ["cpu:0", "cpu:1"]
    j = isl.s.jobs[job]
    assert j.state is JobState.STARTING and j.requested_devices == 2 and j.error is None
    assert j.resizes[-1].outcome == "rolled back" and "agent 3 exited" in j.resizes[-1].note
    assert "failed half-way" in j.history[-1][2]
    # a heartbeat about the agents before the fall-back neither fails the job nor makes a forget its snapshot
    out = isl.report("a", report(job, [agent(0, 0, alive=False), agent(1, 1, alive=False)], state="ended",
                                 ok=False))
    assert isl.state(job) is JobState.STARTING and not kills(out)
    isl.report("a", report(job, [agent(0, 0), agent(1, 1)], master_port=99, restore_epoch=1))
    assert isl.state(job) is JobState.RUNNING and isl.s.free_count() == 2   # b's devices are free again


def test_losing_the_node_of_the_joiners_mid_hand_over_falls_back_on_the_nodes_that_hold_the_snapshot():
    isl = Island(node_timeout_s=5.0)
    job = growing_onto_node_b(isl)
    isl.now += 4.0
    isl.report("a", report(job, [agent(0, 0), agent(1, 1)], resize_epoch=1, snapshot_epoch=1,
                           snapshot_parts=[-1, 0, 1, 2, 3]))
    out = isl.tick(2.0)   # b is silent past the node timeout
    assert kills(out) == [("a", job)] and isl.s.jobs[job].resize.phase == "rollback"
    out = isl.report("a", report(job, [agent(0, 0, alive=False), agent(1, 1, alive=False)], state="ended",
                                 ok=False, snapshot_epoch=1, snapshot_parts=[-1, 0, 1, 2, 3]))
    ((node, launch),) = launches(out)
    j = isl.s.jobs[job]
    assert node == "a" and launch.restore_epoch == 1 and j.state is JobState.STARTING
    assert "resize 1 (2 -> 4 devices, scale command) failed: node b" in j.resizes[-1].note, j.resizes[-1]


def test_a_fall_back_across_nodes_relaunches_rank_0_first_and_the_others_once_its_port_is_known():
    isl = Island(node_timeout_s=1e9)
    isl.hello("a", 1)
    isl.hello("b", 1)
    job, out = isl.submit(workers=4, lo=2, hi=2)
    isl.report("a", report(job, [agent(0, 0)], master_port=7))
    isl.report("b", report(job, [agent(1, 0)]))
    assert isl.state(job) is JobState.RUNNING
    isl.s.scale(job, 1, isl.now)
    isl.report("a", report(job, [agent(0, 0)], resize_epoch=1, resize_port=5))
    # b's agent left after handing its ranks over; a's agent then died: the parts are split over a and b
    isl.report("b", report(job, [agent(1, 0, alive=False, left=True, epoch=1)], state="ended",
                           snapshot_epoch=1, snapshot_parts=[2, 3]))
    out = isl.report("a", report(job, [agent(0, 0, alive=False)], state="ended", ok=False,
                                 error={"message": "agent 0 raised"}, snapshot_epoch=1, snapshot_parts=[-1, 0, 1]))
    ((node, launch),) = launches(out)
    assert node == "a" and launch.restore_epoch == 1 and launch.devices == 2
    out = isl.report("b", report(job, [agent(1, 0, alive=False)], state="ended"))   # stale: ignored, kept
    assert not kills(out) and isl.state(job) is JobState.STARTING
    out = isl.report("a", report(job, [agent(0, 0)], state="launching", master_port=11, restore_epoch=1))
    ((node, launch),) = launches(out)
    assert node == "b" and launch.restore_epoch == 1 and launch.master_port == 11


def test_resize_phases_time_out_prepare_aborts_go_fails():
    isl = Island(resize_timeout_s=30.0, node_timeout_s=1e9)
    isl.hello("a", 4)
    job = running_job(isl, devices=2)
    isl.s.scale(job, 3, isl.now)
    isl.report("a", report(job, [agent(0, 0), agent(1, 1)], resize_epoch=1, resize_port=5))
    out = isl.tick(31.0)
    assert of(out, p.AbortResize) and isl.state(job) is JobState.RUNNING
    assert "joining ranks [2] not ready within 30s" in isl.s.jobs[job].resizes[-1].note
    isl.report("a", report(job, [agent(0, 0), agent(1, 1)]))   # the joiner is gone
    isl.s.scale(job, 1, isl.now)
    isl.report("a", report(job, [agent(0, 0), agent(1, 1)], resize_epoch=2, resize_port=6))
    isl.report("a", report(job, [agent(0, 0, epoch=2)], resize_epoch=2))
    out = isl.tick(31.0)
    assert kills(out) == [("a", job)] and isl.s.jobs[job].resize.phase == "rollback"
    isl.report("a", report(job, [agent(0, 0, alive=False, epoch=2)], state="ended", ok=False))
    j = isl.s.jobs[job]
    assert j.state is JobState.FAILED
    assert "resize 2 (2 -> 1 devices" in j.error["message"] and "rank 0 did not complete a step" in j.error["message"]
    assert "no complete snapshot" in j.error["message"]


def test_job_finishing_before_the_joiners_are_warm_finishes_and_sends_them_away():
    isl = Island()
    isl.hello("a", 2)
    job = running_job(isl, devices=2, hi=2)
    isl.hello("b", 2)
    first, other = "a", "b"
    isl.s.scale(job, 4, isl.now)
    isl.report(other, report(job, [agent(2, 0, standby=False), agent(3, 1, standby=False)], state="launching"))
    out = isl.report(first, report(job, [agent(0, 0, False), agent(1, 1, False)], state="ended"))
    j = isl.s.jobs[job]
    assert j.state is JobState.FINISHED and j.resizes[-1].outcome == "not applied"
    assert (other, job) in kills(out) or any(n == other for n, _ in of(out, p.AbortResize))
    assert isl.s.free_count() == 2   # the joiners' devices: taken until node b reports them gone
    isl.report(other, report(job, [agent(2, 0, False), agent(3, 1, False)], state="ended"))
    assert isl.s.free_count() == 4


def test_scale_to_the_current_size_is_a_no_op_and_bad_requests_are_refused():
    isl = Island()
    isl.hello("a", 2)
    job = running_job(isl, devices=1, workers=4, hi=1)
    blocker = running_job(isl, devices=1, workers=1)   # noqa: F841 - holds the other device
    msg, out = isl.s.scale(job, 1, isl.now)
    assert "already runs on 1" in msg and out == [] and isl.state(job) is JobState.RUNNING
    with pytest.raises(SchedulerError) as e:
        isl.s.scale(job, 2, isl.now)
    assert e.value.code == p.INVALID_STATE and "0 free" in e.value.message
    for bad, code in ((0, p.BAD_REQUEST), (5, p.BAD_REQUEST)):
        with pytest.raises(SchedulerError) as e:
            isl.s.scale(job, bad, isl.now)
        assert e.value.code == code
    with pytest.raises(SchedulerError) as e:
        isl.s.scale("j404", 1, isl.now)
    assert e.value.code == p.UNKNOWN_JOB


def test_high_priority_job_shrinks_a_running_elastic_job_which_grows_back_when_it_finishes():
    isl = Island()
    isl.hello("a", 4)
    low = running_job(isl, workers=4, lo=1, hi=4)
    high, out = isl.submit(workers=2, lo=2, hi=2, prio=5)
    assert launches(out) == [] and isl.state(high) is JobState.QUEUED
    ((_, prep),) = of(out, p.PrepareResize)
    assert prep.job_id == low and prep.devices == 2
    assert isl.s.jobs[low].resize.why == f"policy: preempted by job {high}"
    complete(isl, "a", low, 1, 2, 4)
    assert isl.state(low) is JobState.RUNNING and isl.state(high) is JobState.STARTING
    (_, launch), = [x for x in launches(isl.sent) if x[1].job_id == high]
    assert sorted(pl.device_id for pl in launch.placements) == ["cpu:2", "cpu:3"]
    isl.report("a", report(high, [agent(0, 2), agent(1, 3)], master_port=9))
    out = isl.report("a", report(high, [agent(0, 2, False), agent(1, 3, False)], state="ended"))
    assert isl.state(high) is JobState.FINISHED
    ((_, prep),) = of(out, p.PrepareResize)
    assert prep.job_id == low and prep.devices == 4 and [pl.rank for pl in prep.joiners] == [2, 3]
    complete(isl, "a", low, 2, 4, 2)
    j = isl.s.jobs[low]
    assert [(r.src, r.dst, r.why, r.outcome) for r in j.resizes] == [
        (4, 2, f"policy: preempted by job {high}", "done"), (2, 4, "policy: grow into freed devices", "done")]


def test_policy_leaves_pinned_jobs_and_equal_priorities_alone():
    isl = Island()
    isl.hello("a", 4)
    pinned = running_job(isl, workers=4, lo=1, hi=4)
    isl.s.scale(pinned, 4, isl.now)   # the user's word: 4
    _, out = isl.submit(workers=2, lo=2, hi=2, prio=5)
    assert of(out, p.PrepareResize) == []
    isl2 = Island()
    isl2.hello("a", 4)
    running_job(isl2, workers=4, lo=1, hi=4, prio=5)
    _, out = isl2.submit(workers=2, lo=2, hi=2, prio=5)
    assert of(out, p.PrepareResize) == []


def test_resize_in_flight_survives_a_round_trip_through_the_job_table():
    isl = Island()
    isl.hello("a", 4)
    job = running_job(isl, devices=2)
    isl.s.scale(job, 4, isl.now)
    doc = isl.s.jobs[job].to_doc()
    back = Job.from_doc(doc)
    assert back.resize == isl.s.jobs[job].resize and back.resize.joiners == [2, 3] and back.to_doc() == doc


def test_a_restarted_scheduler_carries_a_resize_in_flight_to_its_end():
    isl = Island()
    isl.hello("a", 4)
    job = running_job(isl, devices=2)
    isl.s.scale(job, 4, isl.now)
    saved = [Job.from_doc(j.to_doc()) for j in isl.s.jobs.values()]
    again = Island(jobs=saved)   # a new scheduler process over the same job table
    again.now = isl.now + 1
    joiners = [agent(0, 0), agent(1, 1), agent(2, 2, standby=True), agent(3, 3, standby=True)]
    out = again.hello("a", 4, jobs=[report(job, joiners, resize_epoch=1, resize_port=42)])
    ((_, go),) = of(out, p.ResizeJob)
    assert go.master_port == 42 and go.devices == 4
    again.report("a", report(job, [agent(r, r, epoch=1, stepped=1 if r == 0 else 0) for r in range(4)],
                             resize_epoch=1))
    j = again.s.jobs[job]
    assert j.state is JobState.RUNNING and len(j.placement) == 4 and j.resizes[-1].outcome == "done"


def test_a_scheduler_restarted_mid_rollback_finishes_the_fall_back_from_its_stored_table(tmp_path):
    from elasticd.scheduler.store import JobStore

    isl = Island(node_timeout_s=1e9)
    isl.hello("a", 4)
    job = running_job(isl, devices=2, lo=2, hi=2)
    isl.s.scale(job, 4, isl.now)
    isl.report("a", report(job, [agent(0, 0), agent(1, 1), agent(2, 2, standby=True), agent(3, 3, standby=True)],
                           resize_epoch=1, resize_port=5))
    isl.s.tick(isl.now + 1e6)   # the hand-over never finishes: roll back
    assert isl.s.jobs[job].resize.phase == "rollback"
    store = JobStore(tmp_path / "jobs.db")
    store.save(isl.s.take_dirty())
    store.close()
    again = Island(JobStore(tmp_path / "jobs.db").load(), node_timeout_s=1e9)
    again.hello("a", 4, jobs=[report(job, [agent(r, r, alive=False) for r in range(4)], state="ended", ok=False,
                                     snapshot_epoch=1, snapshot_parts=[-1, 0, 1, 2, 3])])
    ((node, launch),) = launches(again.sent)
    j = again.s.jobs[job]
    assert node == "a" and launch.restore_epoch == 1 and j.state is JobState.STARTING
    assert j.resizes[-1].outcome == "rolled back" and "did not re-form" in j.resizes[-1].note


def _shrink_to_go(isl: Island, job: str, **kw) -> tuple[str, list[p.AgentReport]]:
    """Scale a running 4-device job to 2 and send the go; returns the scale reply and the old agents."""
    msg, _ = isl.s.scale(job, 2, isl.now)
    agents = [agent(r, r) for r in range(4)]
    out = isl.report("a", report(job, agents, resize_epoch=1, resize_port=777, **kw))
    assert of(out, p.ResizeJob)
    return msg, agents


def test_a_scale_of_a_job_that_never_enters_ctx_steps_says_so_and_is_recorded_as_refused():
    isl = Island()
    isl.hello("a", 4)
    job = running_job(isl)
    msg, agents = _shrink_to_go(isl, job)   # no report so far carried total_steps: no ctx.steps boundary yet
    assert "has not reached a `ctx.steps` step boundary yet" in msg
    isl.report("a", report(job, [agent(r, r, alive=False) for r in range(4)], state="ended"))
    j = isl.s.jobs[job]
    assert j.state is JobState.FINISHED
    assert j.resizes[-1].outcome == "refused" and "never reached a step boundary of `ctx.steps`" in \
        j.resizes[-1].note, j.resizes


def test_the_resize_history_records_the_step_the_agents_stopped_after():
    isl = Island()
    isl.hello("a", 4)
    job = running_job(isl)
    isl.report("a", report(job, [agent(r, r) for r in range(4)], step=7, metrics={"total_steps": 50}))
    msg, _ = _shrink_to_go(isl, job, step=7, metrics={"total_steps": 50})
    assert "ctx.steps" not in msg
    acked = [agent(0, 0, epoch=1, stepped=1), agent(1, 1, epoch=1), agent(2, 2, epoch=1, left=True),
             agent(3, 3, epoch=1, left=True)]
    isl.report("a", report(job, acked, resize_epoch=1, step=9, metrics={"total_steps": 50},
                           resizes=[resized(epoch=1, seconds=0.2, step=8)]))
    (entry,) = isl.s.jobs[job].resizes
    assert entry.outcome == "done" and entry.step == 8 and entry.done_step == 9, entry


def test_the_pause_rank_0_measured_is_the_resizes_stall_and_not_a_metric_of_the_job():
    """Rank 0 reports, by its own clock, the pause from its last step before the resize to its first after it
    (agent/slicer/boundary.py); the history keeps it as the resize's `stall`, as `elasticd run`'s does, and
    the job's metrics (the user's) do not show it."""
    isl = Island()
    isl.hello("a", 4)
    job = running_job(isl)
    isl.s.scale(job, 2, isl.now)
    isl.report("a", report(job, [agent(r, r) for r in range(4)], resize_epoch=1, resize_port=777))
    acked = [agent(0, 0, epoch=1, stepped=1), agent(1, 1, epoch=1), agent(2, 2, epoch=1, left=True),
             agent(3, 3, epoch=1, left=True)]
    isl.report("a", report(job, acked, resize_epoch=1, step=9, metrics={"resize_stall_s": 0.31, "loss": 1.5},
                           resizes=[resized(epoch=1, seconds=0.2)]))
    j = isl.s.jobs[job]
    (entry,) = j.resizes
    assert entry.outcome == "done" and entry.stall == 0.31 and entry.handover_s == 0.2
    assert j.metrics == {"loss": 1.5}
    assert "training paused 0.31s" in render_job(isl.s.status(job, isl.now).jobs[0])
