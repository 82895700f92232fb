"""The scheduler's job/node tables as a synchronous state machine, driven by hand with a fake clock."""

from __future__ import annotations

import pytest
from island_core import Island, kills, launches, rep

from elasticd import protocol as p
from elasticd.scheduler.jobs import InvalidTransition, Job, JobSpec, JobState
from elasticd.scheduler.state import SchedulerError


def test_single_node_lifecycle_queued_to_finished():
    isl = Island()
    job, out = isl.submit(workers=4, lo=1, hi=2)
    assert isl.state(job) is JobState.QUEUED and out == []
    out = isl.hello("a", 2)
    assert isinstance(out[0].msg, p.Welcome)
    ((node, launch),) = launches(out)
    assert node == "a" and launch.devices == 2 and launch.master_port == 0 and launch.master_addr == "a.host"
    assert [pl.rank for pl in launch.placements] == [0, 1]
    assert isl.state(job) is JobState.STARTING
    isl.report("a", rep(job, "launching", (0, 1), port=4321))
    assert isl.state(job) is JobState.STARTING
    isl.report("a", rep(job, "running", (0, 1), port=4321, step=3, metrics={"loss": 0.5}))
    assert isl.state(job) is JobState.RUNNING
    assert isl.s.status(job, isl.now).jobs[0].metrics == {"loss": 0.5}
    out = isl.report("a", rep(job, "ended", (0, 1), port=4321, step=10))
    assert isl.state(job) is JobState.FINISHED
    ack = [a.msg for a in out if isinstance(a.msg, p.NodeAck)][0]
    assert ack.forget == [job]
    assert [h[1] for h in isl.s.jobs[job].history] == ["queued", "starting", "running", "finished"]


def test_job_spanning_two_nodes_waits_for_rank0_port_then_launches_the_rest():
    isl = Island()
    isl.hello("a", 1)
    isl.hello("b", 1)
    job, out = isl.submit(workers=2, lo=2, hi=2)
    ((first, l0),) = launches(out)
    assert l0.master_port == 0 and [pl.rank for pl in l0.placements] == [0]
    other = "b" if first == "a" else "a"
    out = isl.report(first, rep(job, "launching", (0,), port=5555))
    ((node, l1),) = launches(out)
    assert node == other and l1.master_port == 5555 and l1.master_addr == f"{first}.host"
    assert [pl.rank for pl in l1.placements] == [1]
    isl.report(first, rep(job, "running", (0,), port=5555))
    assert isl.state(job) is JobState.STARTING  # gang: not running until every node's agents are up
    isl.report(other, rep(job, "running", (1,)))
    assert isl.state(job) is JobState.RUNNING
    assert sorted(isl.s.status(job, isl.now).jobs[0].nodes) == ["a", "b"]


def test_agent_failure_fails_the_job_kills_the_rest_and_frees_devices_only_when_confirmed():
    isl = Island()
    isl.hello("a", 1)
    isl.hello("b", 1)
    job, out = isl.submit(workers=2, lo=2, hi=2)
    first = launches(out)[0][0]
    other = "b" if first == "a" else "a"
    isl.report(first, rep(job, "launching", (0,), port=1))
    isl.report(other, rep(job, "running", (1,)))
    isl.report(first, rep(job, "running", (0,), port=1))
    waiting, _ = isl.submit(workers=2, lo=2, hi=2)
    out = isl.report(other, rep(job, "ended", (1,), ok=False, error={"message": "boom", "traceback": "tb"}))
    assert isl.state(job) is JobState.FAILED
    err = isl.s.jobs[job].error
    assert err["message"] == "boom" and err["node"] == other and err["traceback"] == "tb"
    assert kills(out) == [(first, job)]
    # The first node's agent may still hold its device: the next job waits for the confirmation.
    assert isl.state(waiting) is JobState.QUEUED
    out = isl.report(first, rep(job, "ended", (0,), ok=False))
    assert isl.state(waiting) is JobState.STARTING


def test_stop_running_job_kills_agents_and_repeats_the_kill_until_they_are_gone():
    isl = Island(kill_repeat_s=1.0)
    isl.hello("a", 1)
    job, _ = isl.submit(workers=1)
    isl.report("a", rep(job, "running", port=7))
    msg, out = isl.s.stop(job, isl.now)
    assert isl.state(job) is JobState.STOPPED and kills(out) == [("a", job)]
    assert kills(isl.report("a", rep(job, "running"))) == []        # rate limited
    isl.now += 1.5
    assert kills(isl.report("a", rep(job, "running"))) == [("a", job)]
    out = isl.report("a", rep(job, "ended", ok=True))
    assert isl.state(job) is JobState.STOPPED                        # an exit 0 after stop stays stopped
    assert [a.msg.forget for a in out if isinstance(a.msg, p.NodeAck)] == [[job]]
    assert isl.s.stop(job, isl.now)[0].endswith("already stopped")


def test_stop_queued_job():
    isl = Island()
    job, _ = isl.submit()
    _, out = isl.s.stop(job, isl.now)
    assert isl.state(job) is JobState.STOPPED and out == []


def test_node_timeout_recovers_running_job_and_requeues_starting_one():
    isl = Island(node_timeout_s=5.0)
    isl.hello("a", 1)
    isl.hello("b", 1)
    running, _ = isl.submit(workers=1, lo=1, hi=1)
    node_r = isl.s.jobs[running].placement[0][0]
    isl.report(node_r, rep(running, "running"))
    starting, _ = isl.submit(workers=1, lo=1, hi=1)
    node_s = isl.s.jobs[starting].placement[0][0]
    assert node_s != node_r
    isl.now += 4.0
    isl.report(node_r, rep(running, "running"))  # node_r stays alive, node_s goes silent
    out = isl.tick(2.0)
    assert isl.state(running) is JobState.RUNNING
    assert isl.state(starting) is JobState.QUEUED
    assert not isl.s.nodes[node_s].alive
    assert launches(out) == []      # no other free device for the requeued job
    out = isl.tick(10.0)
    # The running job's only device was on the lost node: it waits in the queue to restart from its snapshot.
    job = isl.s.jobs[running]
    assert isl.state(running) is JobState.QUEUED and job.restore_latest and job.restarts == 1
    assert "lost" in job.recovery.cause and job.recovery.kind == "node_lost"


def test_unknown_node_must_say_hello_and_rejoining_resumes():
    isl = Island(node_timeout_s=5.0)
    with pytest.raises(SchedulerError) as e:
        isl.report("ghost")
    assert e.value.code == p.UNKNOWN_NODE
    isl.hello("a", 1)
    isl.tick(6.0)
    with pytest.raises(SchedulerError):
        isl.report("a")
    isl.hello("a", 1)
    isl.report("a")


def test_restart_keeps_table_and_reconciles_with_node_reports():
    isl = Island()
    isl.hello("a", 2)
    keep, _ = isl.submit(workers=1, lo=1, hi=1)
    lost, _ = isl.submit(workers=1, lo=1, hi=1)
    isl.report("a", rep(keep, "running"), rep(lost, "running"))
    done, _ = isl.submit(workers=1, lo=1, hi=1)
    queued, _ = isl.submit(workers=4, lo=4, hi=4)
    isl.report("a", rep(keep, "running"), rep(lost, "ended", ok=True))
    isl.report("a", rep(keep, "running"), rep(done, "running"))
    isl.report("a", rep(keep, "running"), rep(done, "ended"))
    assert isl.state(done) is JobState.FINISHED and isl.state(lost) is JobState.FINISHED
    docs = [j.to_doc() for j in isl.s.jobs.values()]
    # ... the scheduler process dies; a new one loads the table
    isl2 = Island([Job.from_doc(d) for d in docs])
    assert {j: isl2.state(j) for j in (keep, done, queued)} == {
        keep: JobState.RUNNING, done: JobState.FINISHED, queued: JobState.QUEUED}
    isl2.hello("a", 2, jobs=[rep(keep, "running", step=42)])
    assert isl2.state(keep) is JobState.RUNNING and isl2.s.jobs[keep].step == 42
    nxt, _ = isl2.submit(workers=1)
    assert nxt not in (keep, lost, done, queued)


def test_restart_recovers_jobs_whose_node_never_returns_or_forgot_them():
    isl = Island()
    isl.hello("a", 1)
    isl.hello("b", 1)
    on_a, _ = isl.submit(workers=1, lo=1, hi=1)
    on_b, _ = isl.submit(workers=1, lo=1, hi=1)
    node_a = isl.s.jobs[on_a].placement[0][0]
    node_b = isl.s.jobs[on_b].placement[0][0]
    isl.report(node_a, rep(on_a, "running"))
    isl.report(node_b, rep(on_b, "running"))
    isl2 = Island([Job.from_doc(j.to_doc()) for j in isl.s.jobs.values()], node_timeout_s=5.0)
    out = isl2.hello(node_a, 1, jobs=[])     # daemon restarted too: its agents are gone
    # ... so the job restarts there, from its newest snapshot.
    assert isl2.state(on_a) is JobState.STARTING and launches(out)[0][1].restore_latest
    assert isl2.state(on_b) is JobState.RUNNING
    isl2.tick(6.0)                     # node_b never comes back: nowhere to restart, back to the queue
    assert isl2.state(on_b) is JobState.QUEUED and isl2.s.jobs[on_b].restore_latest


def test_stray_job_on_a_node_is_killed():
    isl = Island()
    isl.hello("a", 1)
    out = isl.report("a", rep("j999", "running"))
    assert kills(out) == [("a", "j999")]
    out = isl.report("a", rep("j999", "ended"))
    assert [a.msg.forget for a in out if isinstance(a.msg, p.NodeAck)] == [["j999"]]


def test_scale_validates_and_fixes_queued_job_size():
    isl = Island()
    job, _ = isl.submit(workers=4, lo=1, hi=4)
    with pytest.raises(SchedulerError) as e:
        isl.s.scale("nope", 2, isl.now)
    assert e.value.code == p.UNKNOWN_JOB
    for bad in (0, 5):
        with pytest.raises(SchedulerError) as e:
            isl.s.scale(job, bad, isl.now)
        assert e.value.code == p.BAD_REQUEST
    isl.s.scale(job, 2, isl.now)
    out = isl.hello("a", 4)
    assert launches(out)[0][1].devices == 2


def test_scale_running_job_is_only_recorded_when_live_resize_is_off():
    isl = Island(resize_enabled=False)
    isl.hello("a", 2)
    job, _ = isl.submit(workers=2, lo=1, hi=1)
    isl.report("a", rep(job, "running"))
    msg, out = isl.s.scale(job, 2, isl.now)
    assert isl.s.jobs[job].requested_devices == 2
    assert isl.state(job) is JobState.RUNNING and out == [] and "recorded" in msg


def test_submit_rejects_impossible_sizes():
    isl = Island()
    for workers, lo, hi in ((0, 1, 1), (2, 3, 3), (2, 2, 1), (2, 0, 2)):
        with pytest.raises(SchedulerError) as e:
            isl.submit(workers=workers, lo=lo, hi=hi)
        assert e.value.code == p.BAD_REQUEST


def test_start_timeout_fails_job():
    isl = Island(start_timeout_s=30.0, node_timeout_s=1e9)
    isl.hello("a", 1)
    job, _ = isl.submit(workers=1)
    out = isl.tick(31.0)
    assert isl.state(job) is JobState.FAILED and kills(out) == [("a", job)]


def test_priority_orders_queued_jobs_when_devices_free_up():
    isl = Island()
    isl.hello("a", 2)
    blocker, _ = isl.submit(workers=2, lo=2, hi=2)
    isl.report("a", rep(blocker, "running", (0, 1)))
    low, _ = isl.submit(workers=2, lo=2, hi=2, prio=0)
    high, _ = isl.submit(workers=2, lo=2, hi=2, prio=5)
    isl.report("a", rep(blocker, "ended", (0, 1)))
    assert isl.state(high) is JobState.STARTING and isl.state(low) is JobState.QUEUED


def test_transitions_are_explicit():
    job = Job(job_id="j1", seq=1, spec=JobSpec("/s.py", None, 2, 1, 2))
    with pytest.raises(InvalidTransition):
        job.transition(JobState.RUNNING, 1.0)
    job.transition(JobState.STARTING, 1.0)
    job.transition(JobState.RUNNING, 2.0)
    job.transition(JobState.FINISHED, 3.0)
    for dst in JobState:
        with pytest.raises(InvalidTransition):
            job.transition(dst, 4.0)


def _two_node_job(isl: Island, **submit) -> tuple[str, str, str]:
    isl.hello("a", 1)
    isl.hello("b", 1)
    job, out = isl.submit(workers=4, lo=1, hi=2, **submit)
    first = launches(out)[0][0]
    other = "b" if first == "a" else "a"
    isl.report(first, rep(job, "launching", (0,), port=1))
    isl.report(other, rep(job, "running", (1,)))
    isl.report(first, rep(job, "running", (0,), port=1, step=12, metrics={"total_steps": 40}))
    return job, first, other


def test_a_recoverys_figures_come_from_the_agents_beats_and_clocks_not_from_the_last_report():
    """Rank 0's reports are throttled (step 12 was the last heard), the agents' beat files say step 14
    completed: failed_after_step is 14. The first step after the restart completed 1.5 s after the failure
    by the agent's clock, heard of 3 s after: the recovery took 1.5 s."""
    isl = Island()
    job, first, other = _two_node_job(isl)
    died = {"message": "agent 1 was killed by SIGKILL", "cause": "died", "exitcode": -9}
    agent = p.AgentReport(rank=1, device_id="cpu:0", pid=11, alive=False, connected=True, exitcode=-9, completed=13)
    isl.report(other, rep(job, "ended", (1,), ok=False, error=died, agents=[agent]))
    j = isl.s.jobs[job]
    failed_at = j.recovery.record.at
    assert j.recovery.record.failed_after_step == 13
    survivor = p.AgentReport(rank=0, device_id="cpu:0", pid=10, alive=False, connected=True, exitcode=3, completed=14)
    lost = {"message": "a collective of the agents' group failed", "cause": "peer_lost"}
    out = isl.report(first, rep(job, "ended", (0,), ok=False, error=lost, agents=[survivor]))
    assert j.recovery.record.failed_after_step == 14
    [(node, _)] = launches(out)
    isl.now += 3.0
    isl.report(node, rep(job, "running", (0,), port=2, step=10, incarnation=1,
                         metrics={"resumed_from": 10, "resumed_at": failed_at + 1.5}))
    [rec] = j.recoveries
    assert rec.failed_after_step == 14 and rec.steps_redone == 5 and rec.seconds == 1.5


def test_an_agent_killed_restarts_the_job_from_its_snapshot_once_every_agent_is_gone():
    isl = Island()
    job, first, other = _two_node_job(isl)
    died = {"message": "agent 1 was killed by SIGKILL", "cause": "died", "exitcode": -9}
    out = isl.report(other, rep(job, "ended", (1,), ok=False, error=died))
    j = isl.s.jobs[job]
    assert isl.state(job) is JobState.RECOVERING and kills(out) == [(first, job)]
    assert j.recovery.record.failed_after_step == 12 and "SIGKILL" in j.recovery.cause
    assert launches(out) == []        # not while an agent of the job may still run
    # The survivor lost its group; its report must not replace the first cause.
    lost = {"message": "a collective of the agents' group failed", "cause": "peer_lost"}
    out = isl.report(first, rep(job, "ended", (0,), ok=False, error=lost))
    assert isl.state(job) is JobState.STARTING and "SIGKILL" in j.recovery.cause
    [(node, launch)] = launches(out)
    assert node == j.nodes[0] and launch.restore_latest and launch.incarnation == 1 == j.incarnation
    assert len(j.placement) == 2 and j.restarts == 1
    # A heartbeat of the old agents, sent before the node got the launch, is not the new agents' failure.
    isl.report(first, rep(job, "ended", (0,), ok=False, error=lost, incarnation=0))
    assert isl.state(job) is JobState.STARTING
    isl.report(node, rep(job, "running", (0,), port=2, incarnation=1))
    other_node = "b" if node == "a" else "a"
    isl.report(other_node, rep(job, "running", (1,), incarnation=1))
    isl.now += 3.0
    isl.report(node, rep(job, "running", (0,), port=2, step=10, incarnation=1,
                         metrics={"resumed_from": 10, "snapshot_step": 10, "snapshot_bytes": 2048}))
    [rec] = j.recoveries
    assert rec.resumed_from == 10 and rec.steps_redone == 3 and rec.seconds == 3.0
    assert j.recovery is None and not j.restore_latest and isl.state(job) is JobState.RUNNING
    info = isl.s.status(job, isl.now).jobs[0]
    assert info.recoveries == [rec] and info.snapshot == {"step": 10, "bytes": 2048}
    assert "resumed_from" not in info.metrics and "snapshot_step" not in info.metrics


def test_a_recovery_records_the_devices_the_job_resumed_on_when_its_restart_lost_a_node_too():
    """The restart was placed on both nodes, and one of them was lost before the job came up: it starts again
    on the one left. Its record says so (1 device), not the placement the first restart attempt had."""
    isl = Island()
    job, first, other = _two_node_job(isl)
    died = {"message": "agent 1 was killed by SIGKILL", "cause": "died", "exitcode": -9}
    isl.report(other, rep(job, "ended", (1,), ok=False, error=died))
    lost = {"message": "a collective of the agents' group failed", "cause": "peer_lost"}
    out = isl.report(first, rep(job, "ended", (0,), ok=False, error=lost))
    j = isl.s.jobs[job]
    assert isl.state(job) is JobState.STARTING and len(j.placement) == 2 and launches(out)
    isl._take(isl.s.node_bye(other, isl.now))
    assert isl.state(job) is JobState.QUEUED and j.recovery is not None   # its start interrupted: queued again
    out = isl.report(first, rep(job, "ended", (0,), ok=False, incarnation=1, error={"message": "killed"}))
    [(node, launch)] = launches(out)   # the device freed: restarted on the one node left
    assert node == first and launch.devices == 1 and launch.restore_latest
    isl.report(first, rep(job, "running", (0,), port=2, incarnation=launch.incarnation))
    isl.report(first, rep(job, "running", (0,), port=2, step=10, incarnation=launch.incarnation,
                          metrics={"resumed_from": 10}))
    [rec] = j.recoveries
    assert (rec.from_devices, rec.devices, rec.resumed_from) == (2, 1, 10), rec


def test_a_worker_exception_is_not_retried_even_when_a_survivor_is_heard_first():
    isl = Island()
    job, first, other = _two_node_job(isl)
    lost = {"message": "a collective of the agents' group failed", "cause": "peer_lost"}
    isl.report(other, rep(job, "ended", (1,), ok=False, error=lost))
    assert isl.state(job) is JobState.RECOVERING
    user = {"message": "ValueError: bad batch", "cause": "user", "logical_rank": 1, "traceback": "tb"}
    out = isl.report(first, rep(job, "ended", (0,), ok=False, error=user))
    assert isl.state(job) is JobState.FAILED and launches(out) == []
    assert isl.s.jobs[job].error["message"] == "ValueError: bad batch"


def test_a_user_error_fails_at_once_and_restarts_stop_at_max_restarts():
    isl = Island()
    job, first, other = _two_node_job(isl)
    user = {"message": "ValueError: bad batch", "cause": "user"}
    isl.report(other, rep(job, "ended", (1,), ok=False, error=user))
    assert isl.state(job) is JobState.FAILED and isl.s.jobs[job].restarts == 0

    isl = Island()
    job, _ = isl.submit(workers=2, lo=1, hi=1)
    isl.s.jobs[job].spec.max_restarts = 0
    isl.hello("a", 1)
    isl.report("a", rep(job, "running", (0,), port=1))
    isl.report("a", rep(job, "ended", (0,), ok=False, error={"message": "agent 0 was killed by SIGKILL",
                                                             "cause": "died"}))
    assert isl.state(job) is JobState.FAILED
    assert "not restarting: 0 restart(s) of --max-restarts 0 used" in isl.s.jobs[job].error["message"]


def test_a_lost_node_restarts_the_job_on_the_devices_left():
    isl = Island(node_timeout_s=5.0)
    job, first, other = _two_node_job(isl)
    isl.now += 4.0
    isl.report(first, rep(job, "running", (0,), port=1, step=12))
    out = isl.tick(2.0)               # `other` went silent
    assert isl.state(job) is JobState.RECOVERING and kills(out) == [(first, job)]
    out = isl.report(first, rep(job, "ended", (0,), ok=False, error={"cause": "peer_lost", "message": "x"}))
    j = isl.s.jobs[job]
    assert isl.state(job) is JobState.STARTING and j.placement == [[first, "cpu:0"]]
    assert launches(out)[0][1].devices == 1 and j.recovery.record.devices == 1


def test_submit_refuses_a_bad_snapshot_interval():
    isl = Island()
    with pytest.raises(SchedulerError) as e:
        isl.s.submit(p.Submit(script="/s.py", workers=2, snapshot_every="soon"), isl.now)
    assert e.value.code == p.BAD_REQUEST and "snapshot" in e.value.message


def test_a_torchrun_mode_job_resizes_by_restarting_at_the_new_size():
    """No step boundary to hand over at: `scale` stops every agent, then starts the job on the new devices
    with its restart count one higher and its step count going on; the history says `restarted`, and
    --max-restarts is not spent. A policy shrink (a higher-priority job) takes the same path."""
    from elasticd.core.env_names import RESTARTS_VAR, STEP_OFFSET_VAR

    isl = Island()
    job_obj, out = isl.s.submit(p.Submit(script="/t.py", workers=4, min_devices=1, max_devices=2, torchrun=True),
                                isl.now)
    job = job_obj.job_id
    isl.hello("a", 2)
    isl.report("a", rep(job, "running", (0, 1), port=1, step=7))
    assert isl.state(job) is JobState.RUNNING and len(isl.s.jobs[job].placement) == 2
    msg, out = isl.s.scale(job, 1, isl.now)
    out = isl._take(out)
    j = isl.s.jobs[job]
    assert "restarting on 1 devices" in msg and kills(out) == [("a", job)] and launches(out) == []
    assert isl.state(job) is JobState.RECOVERING
    assert [(r.src, r.dst, r.outcome) for r in j.resizes] == [(2, 1, "restarting")]
    # The killed agents' report (infrastructure causes, as for a recovery) lets it start again.
    killed = {"message": "agent 0 was killed by SIGKILL", "cause": "died"}
    out = isl.report("a", rep(job, "ended", (0, 1), ok=False, error=killed))
    [(node, launch)] = launches(out)
    assert node == "a" and launch.devices == 1 and launch.incarnation == 1 and not launch.restore_latest
    assert launch.env[RESTARTS_VAR] == "1" and launch.env[STEP_OFFSET_VAR] == "7"
    assert j.restarts == 0 and isl.state(job) is JobState.STARTING
    isl.now += 2.0
    isl.report("a", rep(job, "running", (0,), port=2, step=7, incarnation=1))   # up, not stepped yet
    assert j.resizes[-1].outcome == "restarting"
    isl.report("a", rep(job, "running", (0,), port=2, step=8, incarnation=1))
    assert [(r.src, r.dst, r.outcome, r.seconds) for r in j.resizes] == [(2, 1, "restarted", 2.0)]
    assert j.recovery is None and j.recoveries == [] and isl.state(job) is JobState.RUNNING
    from elasticd.scheduler.events import job_events

    [ev] = [e for e in job_events(j) if e.event == "resized"]
    assert ev.src == 2 and ev.dst == 1 and "restarting the torchrun-mode job" in ev.detail
    # Stopped while restarting at a new size: that resize did not happen, and the history says so.
    isl._take(isl.s.scale(job, 2, isl.now)[1])
    isl._take(isl.s.stop(job, isl.now)[1])
    assert isl.state(job) is JobState.STOPPED and j.resizes[-1].outcome == "not applied"


def test_the_policy_shrinks_and_grows_a_torchrun_mode_job_by_restarts():
    isl = Island()
    tjob, _ = isl.s.submit(p.Submit(script="/t.py", workers=4, min_devices=1, max_devices=2, torchrun=True), isl.now)
    job = tjob.job_id
    isl.hello("a", 2)
    isl.report("a", rep(job, "running", (0, 1), port=1, step=3))
    urgent, out = isl.submit(workers=1, lo=1, hi=1, prio=5)   # does not fit: the policy shrinks the job
    out = isl._take(out) + isl.tick(1.0)
    assert isl.state(job) is JobState.RECOVERING and ("a", job) in kills(isl.sent)
    out = isl.report("a", rep(job, "ended", (0, 1), ok=False, error={"message": "killed", "cause": "died"}))
    assert [(n, m.devices) for n, m in launches(out) if m.job_id == job] == [("a", 1)]
    isl.report("a", rep(job, "running", (0,), port=2, step=4, incarnation=1))
    assert isl.s.jobs[job].resizes[-1].outcome == "restarted" and isl.state(job) is JobState.RUNNING
    out = isl.tick(1.0)
    assert [m.job_id for _, m in launches(isl.sent)].count(urgent) == 1   # the freed device went to it
    isl.report("a", rep(urgent, "running", (0,), port=3), rep(job, "running", (0,), port=2, step=5, incarnation=1))
    isl.report("a", rep(urgent, "ended", (0,), port=3), rep(job, "running", (0,), port=2, step=6, incarnation=1))
    isl.tick(1.0)   # its device is free again: the policy grows the job back, by a restart
    assert isl.state(job) is JobState.RECOVERING
    out = isl.report("a", rep(job, "ended", (0,), ok=False, error={"message": "killed", "cause": "died"},
                              incarnation=1))
    assert [(n, m.devices, m.incarnation) for n, m in launches(out)] == [("a", 2, 2)]
    isl.report("a", rep(job, "running", (0, 1), port=4, step=7, incarnation=2))
    assert [(r.src, r.dst, r.outcome) for r in isl.s.jobs[job].resizes] == [(2, 1, "restarted"),
                                                                                      (1, 2, "restarted")]
