"""Resizes at exact steps (`submit --scale-at`) in the scheduler's state machine, driven by hand: the held
steps the agents are launched with, the resize started once rank 0 reports the step, the release of agents
held for a resize that cannot happen, and the schedule dropped with a refusal."""

from __future__ import annotations

import pytest
from island_core import Island, agent, complete, kills, launches, of, rep, report

from elasticd import protocol as p
from elasticd.cli.status import render_job
from elasticd.scheduler.jobs import Job, JobState
from elasticd.scheduler.state import SchedulerError


def entry(step: int, devices: int, blocks: list[int] | None = None) -> p.ScaleAt:
    return p.ScaleAt(step=step, devices=devices, blocks=blocks or [])


def submit(isl: Island, workers: int, hi: int, schedule: list[tuple], blocks: list[int] | None = None
           ) -> tuple[str, p.LaunchJob]:
    job, out = isl.s.submit(p.Submit(script="/s.py", workers=workers, min_devices=len(blocks) if blocks else 1,
                                     max_devices=hi, blocks=blocks or [],
                                     scale_at=[entry(*e) for e in schedule]), isl.now)
    ((_, launch),) = launches(isl._take(out))
    isl.report("a", report(job.job_id, [agent(r, r) for r in range(hi)], master_port=1234))
    assert isl.state(job.job_id) is JobState.RUNNING
    return job.job_id, launch


def step(isl: Island, job: str, n: int, devices: int, agents: list[p.AgentReport] | None = None, **kw) -> list:
    """Node a's report of the job at step `n` (its agents: `devices` running ones unless given)."""
    return isl.report("a", report(job, agents or [agent(r, r) for r in range(devices)], step=n, **kw))


def test_the_agents_hold_each_scheduled_step_and_the_resize_starts_when_rank_0_reports_it():
    isl = Island()
    isl.hello("a", 4)
    job, launch = submit(isl, 4, 4, [(5, 2), (10, 4)])
    assert launch.hold_at == [5, 10]
    assert of(step(isl, job, 4, 4), p.PrepareResize) == []
    ((_, prep),) = of(step(isl, job, 5, 4), p.PrepareResize)
    assert (prep.devices_from, prep.devices) == (4, 2)
    complete(isl, "a", job, 1, 2, 4)
    j = isl.s.jobs[job]
    assert j.resizes[-1].why == "--scale-at 5:2" and j.resizes[-1].outcome == "done" and j.resizes[-1].step == 5
    assert j.requested_devices == 2 and j.hold_at == [10]
    info = isl.s.status(job, isl.now).jobs[0]
    assert info.scale_at == [p.ScaleAt(step=10, devices=4)]   # what is still to come
    assert "scale at   after step 10 -> 4 device(s)" in render_job(info)
    ((_, prep),) = of(step(isl, job, 10, 2), p.PrepareResize)
    assert (prep.devices_from, prep.devices) == (2, 4) and prep.hold_at == []   # nothing left to hold for
    assert [pl.rank for pl in prep.joiners] == [2, 3]


def test_a_grow_without_free_devices_is_refused_and_the_held_agents_are_released_in_place():
    isl = Island()
    isl.hello("a", 2)
    job, launch = submit(isl, 4, 2, [(3, 4), (6, 1)])
    assert launch.hold_at == [3, 6]
    out = step(isl, job, 3, 2)
    ((_, prep),) = of(out, p.PrepareResize)
    assert prep.devices_from == prep.devices == 2 and prep.joiners == []   # the release: nothing moves
    j = isl.s.jobs[job]
    (refused,) = j.resizes
    assert refused.outcome == "refused" and refused.why == "--scale-at 3:4" and "0 device(s) free" in refused.note
    isl.report("a", report(job, [agent(0, 0), agent(1, 1)], step=3, resize_epoch=1, resize_port=9))
    ((_, go),) = of(isl.sent, p.ResizeJob)
    assert (go.devices_from, go.devices, go.blocks) == (2, 2, j.resize.blocks)
    isl.report("a", report(job, [agent(0, 0, epoch=1, stepped=1), agent(1, 1, epoch=1)], step=4, resize_epoch=1))
    assert j.state is JobState.RUNNING and j.resize is None and j.held is None
    assert len(j.resizes) == 1 and "released" in j.history[-1][2]   # a release is not a resize of the user's
    assert j.hold_at == [6]
    ((_, prep),) = of(step(isl, job, 6, 2), p.PrepareResize)   # the next entry is a shrink: it happens
    assert (prep.devices_from, prep.devices) == (2, 1)


def test_a_resize_the_agents_refuse_drops_the_rest_of_the_schedule_as_they_drop_their_held_steps():
    isl = Island()
    isl.hello("a", 4)
    job, _ = submit(isl, 4, 4, [(5, 2), (10, 1), (20, 4)])
    step(isl, job, 5, 4)
    isl.report("a", report(job, [agent(r, r) for r in range(4)], step=5, resize_epoch=1, resize_port=9))
    isl.report("a", report(job, [agent(r, r) for r in range(4)], step=5, resize_epoch=1,
                           resize_error={"message": "cannot carry `x`", "refused": True, "step": 5}))
    j = isl.s.jobs[job]
    assert j.state is JobState.RUNNING and len(j.placement) == 4 and j.hold_at == []
    assert [(e.why, e.outcome) for e in j.resizes] == [("--scale-at 5:2", "refused"), ("--scale-at 10:1", "refused"),
                                                       ("--scale-at 20:4", "refused")]
    assert "dropped" in j.resizes[1].note and "cannot carry `x`" in j.resizes[1].note
    assert of(step(isl, job, 10, 4), p.PrepareResize) == []


def test_the_schedule_survives_a_scheduler_restart():
    isl = Island()
    isl.hello("a", 4)
    job, _ = submit(isl, 4, 4, [(5, 2), (10, 4)])
    step(isl, job, 5, 4)
    doc = isl.s.jobs[job].to_doc()
    back = Job.from_doc(doc)
    assert back.spec.scale_at == [entry(5, 2), entry(10, 4)] and back.hold_at == [10] and back.held == 5


def test_a_torchrun_mode_job_is_restarted_at_each_scheduled_step_and_at_its_size_when_a_grow_cannot_be_placed():
    isl = Island()
    isl.hello("a", 2)
    j, out = isl.s.submit(p.Submit(script="/s.py", workers=4, max_devices=2, torchrun=True,
                                   scale_at=[entry(3, 1), entry(6, 4)]), isl.now)
    job = j.job_id
    ((_, launch),) = launches(isl._take(out))
    assert launch.hold_at == [3, 6]   # optimizer steps (agent/script_main.py)
    isl.report("a", rep(job, "running", (0, 1), port=1, step=2))
    out = isl.report("a", rep(job, "running", (0, 1), port=1, step=3))
    assert isl.state(job) is JobState.RECOVERING and kills(out) == [("a", job)]   # held agents stop: a restart
    assert [(e.why, e.outcome, e.dst) for e in j.resizes] == [("--scale-at 3:1", "restarting", 1)]
    killed = {"message": "agent 0 was killed by SIGKILL", "cause": "died"}
    ((_, launch),) = launches(isl.report("a", rep(job, "ended", (0, 1), ok=False, error=killed)))
    assert launch.devices == 1 and launch.hold_at == [6]   # what is left of the schedule
    isl.report("a", rep(job, "running", (0,), port=2, step=4, incarnation=1))
    assert j.resizes[-1].outcome == "restarted" and isl.state(job) is JobState.RUNNING
    out = isl.report("a", rep(job, "running", (0,), port=2, step=6, incarnation=1))   # 4 devices: 1 free
    assert [(e.why, e.outcome) for e in j.resizes[1:]] == [("--scale-at 6:4", "refused"),
                                                           ("release after step 6", "restarting")]
    assert j.resizes[2].src == j.resizes[2].dst == 1 and kills(out) == [("a", job)]   # it cannot go on in place


def test_blocks_asked_for_at_a_step_re_lay_the_job_out_there_and_pin_the_layout():
    isl = Island()
    isl.hello("a", 2)
    job, launch = submit(isl, 8, 2, [(5, 2, [6, 2]), (9, 1)], blocks=[3, 5])
    j = isl.s.jobs[job]
    assert launch.blocks == [3, 5] and j.layout_pinned   # --layout: the speed model leaves it alone
    ((_, prep),) = of(step(isl, job, 5, 2), p.PrepareResize)
    assert (prep.devices_from, prep.devices, prep.blocks) == (2, 2, [6, 2]) and prep.joiners == []
    complete(isl, "a", job, 1, 2, 2)
    assert j.blocks == [6, 2] and j.layout_pinned and j.resizes[-1].why == "--scale-at 5:2:6/2"
    ((_, prep),) = of(step(isl, job, 9, 2), p.PrepareResize)
    assert prep.devices == 1 and not j.layout_pinned   # a size without blocks: the scheduler's layout again


@pytest.mark.parametrize(("schedule", "torchrun", "words"), [
    ([(5, 2), (5, 1)], False, "ascending"),
    ([(5, 9)], False, "1..4"),
    ([(5, 2, [3, 2])], False, "sum to 5"),
])
def test_a_schedule_that_cannot_be_kept_is_refused_at_submit(schedule, torchrun, words):
    isl = Island()
    with pytest.raises(SchedulerError) as e:
        isl.s.submit(p.Submit(script="/s.py", workers=4, torchrun=torchrun,
                              scale_at=[entry(*e) for e in schedule]), isl.now)
    assert e.value.code == p.BAD_REQUEST and words in e.value.message


def running_on_2(isl: Island, schedule: list[tuple]) -> str:
    isl.hello("a", 4)
    job, launch = submit(isl, 4, 2, schedule)
    assert launch.hold_at == [e[0] for e in schedule]
    return job


def test_a_grow_near_its_step_starts_its_joiners_ahead_and_goes_once_the_agents_hold_there():
    isl = Island()
    job = running_on_2(isl, [(20, 4)])
    assert of(step(isl, job, 5, 2, steps_per_s=1.0), p.PrepareResize) == []      # 15 s away at 1 step/s: too early
    ((_, prep),) = of(step(isl, job, 12, 2, steps_per_s=1.0), p.PrepareResize)   # 8 s away: the joiners start now
    assert (prep.devices_from, prep.devices, [pl.rank for pl in prep.joiners]) == (2, 4, [2, 3])
    assert prep.hold_at == []   # the joiners join after step 20: nothing for them to hold for
    j = isl.s.jobs[job]
    assert j.state is JobState.RESIZING and j.resize.ahead and j.hold_at == []
    assert isl.s.status(job, isl.now).jobs[0].scale_at == []   # in flight, no longer to come
    with pytest.raises(SchedulerError, match=r"preparing its scheduled grow 2 -> 4 devices \(--scale-at 20:4, after step 20\)"):
        isl.s.scale(job, 3, isl.now)
    warm = [agent(0, 0), agent(1, 1), agent(2, 2, standby=True), agent(3, 3, standby=True)]
    assert of(step(isl, job, 14, 2, warm, steps_per_s=1.0, resize_epoch=1, resize_port=9), p.ResizeJob) == []   # ready, not there
    isl.now += 6
    ((_, go),) = of(step(isl, job, 20, 2, warm, steps_per_s=1.0, resize_epoch=1, resize_port=9), p.ResizeJob)
    assert (go.devices_from, go.devices, go.master_port) == (2, 4, 9)
    requested = isl.now
    isl.now += 0.5
    isl.report("a", report(job, [agent(r, r, epoch=1, stepped=1) for r in range(4)], step=21, resize_epoch=1))
    assert j.state is JobState.RUNNING and j.resize is None and len(j.placement) == 4
    (done,) = j.resizes
    assert (done.outcome, done.why, done.step, done.at) == ("done", "--scale-at 20:4", 20, round(requested, 3))
    assert done.seconds == 0.5 and done.prepare_s == 0.0   # counted from the step, the joiners warm by then


def test_a_grow_prepared_ahead_and_called_off_is_tried_again_at_its_step():
    isl = Island()
    job = running_on_2(isl, [(20, 4)])
    ((_, prep),) = of(step(isl, job, 15, 2, steps_per_s=1.0), p.PrepareResize)
    out = step(isl, job, 16, 2, steps_per_s=1.0, resize_epoch=1, resize_error={"message": "joiner 2 died"})
    assert [m.epoch for _, m in of(out, p.AbortResize)] == [1]
    j = isl.s.jobs[job]
    assert j.state is JobState.RUNNING and j.resize is None and j.hold_at == [20]
    assert [(r.outcome, r.why) for r in j.resizes] == [("aborted", "--scale-at 20:4")]
    assert of(step(isl, job, 18, 2, steps_per_s=1.0), p.PrepareResize) == []   # called off once: not prepared ahead again
    ((_, again),) = of(step(isl, job, 20, 2, steps_per_s=1.0), p.PrepareResize)   # the agents hold there: the grow, as asked
    assert (again.epoch, again.devices) == (2, 4) and not j.resize.ahead


def test_devices_a_shrink_freed_are_free_in_the_report_that_completes_it_so_a_grow_is_prepared_there():
    isl = Island()
    isl.hello("a", 4)
    job, _ = submit(isl, 4, 4, [(5, 2), (30, 4)])
    ((_, prep),) = of(step(isl, job, 5, 4), p.PrepareResize)
    assert prep.devices == 2
    isl.report("a", report(job, [agent(r, r) for r in range(4)], step=5, resize_epoch=1, resize_port=9))
    # The leavers exited before rank 0's first step at 2 devices was reported: not in the report that ends it.
    out = isl.report("a", report(job, [agent(r, r, epoch=1, stepped=1) for r in range(2)], step=6,
                                 steps_per_s=10.0, resize_epoch=1))
    j = isl.s.jobs[job]
    assert [r.outcome for r in j.resizes] == ["done"] and j.zombies == {}
    ((_, ahead),) = of(out, p.PrepareResize)   # step 30 is 2.4 s away: the grow starts its joiners now
    assert (ahead.devices_from, ahead.devices) == (2, 4) and j.resize.ahead


@pytest.mark.parametrize(("schedule", "warm"), [([(5, 2), (30, 4)], True), ([(5, 2), (30, 1)], False)],
                         ids=["grows-again", "shrinks-on"])
def test_a_shrink_keeps_its_leavers_warm_only_for_a_grow_still_to_come_and_frees_their_devices(schedule, warm):
    """The leavers of a shrink stay as warm processes where the schedule grows again (as elasticd run keeps
    them): the go says so, and the node's report of them, warm, holds no device, so the grow ahead is
    prepared on the devices they left."""
    isl = Island()
    isl.hello("a", 4)
    job, _ = submit(isl, 4, 4, schedule)
    of(step(isl, job, 5, 4), p.PrepareResize)
    go = of(isl.report("a", report(job, [agent(r, r) for r in range(4)], step=5, resize_epoch=1, resize_port=9)),
            p.ResizeJob)
    assert [m.standby for _, m in go] == [warm]
    stayers = [agent(r, r, epoch=1, stepped=1) for r in range(2)]
    leavers = [agent(r, r, epoch=1, left=True, warm=warm) for r in (2, 3)]
    out = isl.report("a", report(job, stayers + leavers, step=6, steps_per_s=10.0, resize_epoch=1))
    j = isl.s.jobs[job]
    assert [r.outcome for r in j.resizes] == ["done"]
    assert j.zombies == ({} if warm else {"a": ["cpu:2", "cpu:3"]})   # a leaver not kept holds its device until gone
    if warm:
        ((_, ahead),) = of(out, p.PrepareResize)
        assert (ahead.devices_from, ahead.devices) == (2, 4) and [pl.device_id for pl in ahead.joiners] == [
            "cpu:2", "cpu:3"]


def test_a_job_restarted_while_a_grow_is_prepared_ahead_still_resizes_at_its_step():
    isl = Island()
    job = running_on_2(isl, [(20, 4)])
    of(step(isl, job, 15, 2, steps_per_s=1.0), p.PrepareResize)
    j = isl.s.jobs[job]
    assert j.resize.ahead
    died = {"message": "agent 1 was killed by SIGKILL", "cause": "died", "exitcode": -9}
    out = isl.report("a", report(job, [agent(0, 0), agent(1, 1, alive=False, exitcode=-9)], state="ended", ok=False,
                                 error=died, step=15))
    assert j.resize is None and [(r.why, r.outcome) for r in j.resizes] == [("--scale-at 20:4", "not applied")]
    launched = launches(out) or launches(isl.tick(1.0))
    assert launched and all(launch.hold_at == [20] for _, launch in launched)   # the restart holds there again


def test_a_drain_calls_off_a_grow_prepared_ahead_and_moves_the_job_at_once():
    isl = Island()
    isl.hello("b", 2)
    job = running_on_2(isl, [(20, 4)])   # on node a; its grow's joiners go to free devices on a or b
    of(step(isl, job, 15, 2, steps_per_s=1.0), p.PrepareResize)
    j = isl.s.jobs[job]
    assert j.resize.ahead
    _, out = isl.s.drain("a", 60.0, isl.now)
    out = isl._take(out) + isl.tick(0.1)
    assert {m.epoch for _, m in of(out, p.AbortResize)} == {1}   # to each node its joiners were on
    assert [(r.why, r.outcome) for r in j.resizes] == [("--scale-at 20:4", "aborted")] and j.hold_at == [20]
    assert j.resize is not None and j.resize.why.startswith("drain of node a") and not j.resize.ahead


def test_a_job_submitted_while_a_grow_is_prepared_ahead_takes_the_devices_and_the_grow_waits_for_its_step():
    isl = Island()
    job = running_on_2(isl, [(20, 4)])   # node a's 4 devices: 2 running, 2 for the grow's joiners
    of(step(isl, job, 15, 2, steps_per_s=1.0), p.PrepareResize)
    j = isl.s.jobs[job]
    assert j.resize.ahead and isl.s.free_count() == 0
    other, out = isl.s.submit(p.Submit(script="/t.py", workers=2, min_devices=2, max_devices=2), isl.now)
    assert {m.epoch for _, m in of(isl._take(out), p.AbortResize)} == {1}
    assert [(r.why, r.outcome) for r in j.resizes] == [("--scale-at 20:4", "aborted")]
    assert j.state is JobState.RUNNING and j.resize is None and j.hold_at == [20]
    assert other.state is JobState.QUEUED   # the joiners still hold the devices until they are gone
    out = step(isl, job, 16, 2, steps_per_s=1.0)   # the report without them
    assert [launch.job_id for _, launch in launches(out)] == [other.job_id]
    # Not prepared ahead again, and at its step the grow finds no free device: refused there, as without it.
    assert of(step(isl, job, 18, 2, steps_per_s=1.0), p.PrepareResize) == []
    step(isl, job, 20, 2, steps_per_s=1.0)
    assert [(r.why, r.outcome) for r in j.resizes] == [("--scale-at 20:4", "aborted"), ("--scale-at 20:4", "refused")]


def test_no_grow_is_prepared_ahead_while_a_job_waits_for_devices():
    isl = Island()
    job = running_on_2(isl, [(20, 4)])
    waiting, _ = isl.s.submit(p.Submit(script="/t.py", workers=4, min_devices=4, max_devices=4), isl.now)
    assert waiting.state is JobState.QUEUED   # 2 free, 4 needed
    assert of(step(isl, job, 15, 2, steps_per_s=1.0), p.PrepareResize) == []
    assert isl.s.jobs[job].resize is None
    ((_, at_step),) = of(step(isl, job, 20, 2, steps_per_s=1.0), p.PrepareResize)   # at its step, as asked
    assert at_step.devices == 4 and not isl.s.jobs[job].resize.ahead


def test_a_grow_the_agents_refuse_before_the_go_is_refused_drops_the_schedule_and_holds_nothing():
    """The agents stop at the scheduled step while the joiners warm up, and refuse there (a state no snapshot can
    hold): a refusal, not a joiner's failure, and no release is sent to agents that hold no more."""
    isl = Island()
    isl.hello("a", 2)
    job, _ = submit(isl, 4, 1, [(5, 2), (10, 1)])
    ((_, prep),) = of(step(isl, job, 5, 1), p.PrepareResize)
    out = isl.report("a", report(job, [agent(0, 0)], step=5, resize_epoch=1,
                                 resize_error={"message": "cannot carry `warmup`", "refused": True, "step": 5}))
    assert {m.epoch for _, m in of(out, p.AbortResize)} == {1}   # the joiner goes
    j = isl.s.jobs[job]
    assert j.state is JobState.RUNNING and j.resize is None and j.held is None and j.hold_at == []
    assert [(e.why, e.outcome) for e in j.resizes] == [("--scale-at 5:2", "refused"), ("--scale-at 10:1", "refused")]
    assert "cannot carry `warmup`" in j.resizes[0].note and "dropped" in j.resizes[1].note
    out = step(isl, job, 6, 1)
    assert of(out, p.PrepareResize) == [] and of(out, p.ResizeJob) == [] and j.resize is None


def test_a_refusal_at_a_held_step_reported_before_any_resize_began_refuses_that_entry_without_a_resize():
    """The agents stop after the scheduled step and find a state they cannot carry before the scheduler hears
    of the step: the report that brings the step brings the refusal, and no resize begins for a job whose
    agents train on and hold no more."""
    isl = Island()
    isl.hello("a", 2)
    job, _ = submit(isl, 4, 1, [(5, 2), (10, 1)])
    out = step(isl, job, 5, 1, resize_error={"message": "cannot carry `warmup`", "refused": True, "step": 5})
    assert of(out, p.PrepareResize) == [] and of(out, p.ResizeJob) == []
    j = isl.s.jobs[job]
    assert j.state is JobState.RUNNING and j.resize is None and j.held is None and j.hold_at == []
    assert [(e.why, e.step, e.outcome) for e in j.resizes] == [("--scale-at 5:2", 5, "refused"),
                                                               ("--scale-at 10:1", 10, "refused")]
    assert "cannot carry `warmup`" in j.resizes[0].note and "dropped" in j.resizes[1].note
    out = step(isl, job, 11, 1, resize_error={"message": "cannot carry `warmup`", "refused": True, "step": 5})
    assert of(out, p.PrepareResize) == [] and len(j.resizes) == 2


def test_a_refusal_at_the_held_step_reported_after_its_resize_began_refuses_that_resize():
    """The report that brings the held step comes first and the scheduler begins the shrink; the agents' refusal
    there (no resize epoch yet: no command had reached them) comes in the next report. It is this resize's
    refusal: the agents train on and will drop its command as refused already, or end before they read it,
    so waiting for them to act on it would record the resize as not applied when they simply refused it."""
    isl = Island()
    isl.hello("a", 2)
    job, _ = submit(isl, 4, 2, [(5, 1), (10, 2)])
    ((_, prep),) = of(step(isl, job, 5, 2), p.PrepareResize)
    j = isl.s.jobs[job]
    assert j.resize is not None and j.held == 5
    out = step(isl, job, 6, 2, resize_error={"message": "a message is in flight", "refused": True, "step": 5})
    assert {m.epoch for _, m in of(out, p.AbortResize)} == {prep.epoch}   # the node undoes what it began
    assert j.state is JobState.RUNNING and j.resize is None and j.held is None and j.hold_at == []
    assert [(e.why, e.outcome) for e in j.resizes] == [("--scale-at 5:1", "refused"), ("--scale-at 10:2", "refused")]
    assert "a message is in flight" in j.resizes[0].note and "dropped" in j.resizes[1].note


def test_a_torchrun_mode_restart_below_min_devices_the_schedule_asked_for_is_placed_at_once_and_says_so():
    """A --scale-at entry may take a job below --min-devices (elasticd run submits min = max = its --devices):
    the restart at the new size is placed there at once, not queued for devices it does not want, and its
    history says what a torchrun-mode restart does (the script starts again; no snapshot of ours)."""
    isl = Island()
    isl.hello("a", 2)
    j, out = isl.s.submit(p.Submit(script="/t.py", workers=4, min_devices=2, max_devices=2, torchrun=True,
                                   scale_at=[entry(3, 1)]), isl.now)
    job = j.job_id
    isl._take(out)
    isl.report("a", rep(job, "running", (0, 1), port=1, step=3))
    assert isl.state(job) is JobState.RECOVERING and kills(isl.sent) == [("a", job)]
    killed = {"message": "agent 0 was killed by SIGKILL", "cause": "died"}
    [(_, launch)] = launches(isl.report("a", rep(job, "ended", (0, 1), ok=False, error=killed)))
    assert launch.devices == 1 and isl.state(job) is JobState.STARTING
    assert [state for _, state, _ in j.history].count("queued") == 1   # the submission's only
    assert j.history[-1][2] == ("--scale-at 3:1: 2 -> 1 devices: restarting the torchrun-mode job on 1 device(s) "
                                "after optimizer step 3; the script starts again from its beginning (it continues "
                                "where it was only if it loads its own checkpoint)")
