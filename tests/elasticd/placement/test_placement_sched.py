"""Speed-aware placement in the scheduler's and the daemon's state machines, driven by hand (fake clock, no
sockets): block sizes at launch from declared speeds, the learned model fed from node reports, a live
re-layout when a straggler appears and when it goes away, no oscillation, the wire and `--device-speed`."""

from __future__ import annotations

import pytest
from island_core import Island, agent, launches, of, report
from util import cli

from elasticd import protocol as p
from elasticd.cli.status import render, render_job
from elasticd.daemon.actions import SendToAgent as AgentSend
from elasticd.daemon.actions import Spawn
from elasticd.daemon.devices import cpu_devices, parse_speeds, with_speeds
from elasticd.daemon.supervision import Supervision
from elasticd.placement import device_key
from elasticd.placement import uniform_sizes as uniform
from elasticd.placement.speeds import Speeds
from elasticd.scheduler.jobs import JobState
from elasticd.scheduler.store import JobStore

# --- declared speeds --------------------------------------------------------------------------------


def test_device_speed_spec_one_value_or_per_index_with_clear_errors():
    assert parse_speeds("0.5") == (0.5, {})
    assert parse_speeds("0=1.0, 1=0.5") == (None, {0: 1.0, 1: 0.5})
    devs = with_speeds(cpu_devices(3), "1=0.25")
    assert [d.speed for d in devs] == [1.0, 0.25, 1.0]
    assert [d.speed for d in with_speeds(cpu_devices(2), "2")] == [2.0, 2.0]
    assert with_speeds(cpu_devices(2), None) == cpu_devices(2)
    for bad, why in [("", "empty"), ("fast", "not a number"), ("0", "relative speed in"), ("-1", "relative speed"),
                     ("nan", "relative speed"), ("0=1,0=2", "twice"), ("a=1", "INDEX=SPEED"), ("0=x", "not a number"),
                     ("1=inf", "relative speed")]:
        with pytest.raises(ValueError, match=why):
            parse_speeds(bad)
    with pytest.raises(ValueError, match=r"names device\(s\) \[5\]; this node has devices 0,1"):
        with_speeds(cpu_devices(2), "5=0.5")


def test_wire_refuses_blocks_that_are_no_layout_and_speeds_out_of_range():
    ok = p.LaunchJob(job_id="j1", script="/s.py", func=None, workers=8, devices=2, placements=[], master_addr="",
                     master_port=0, blocks=[6, 2])
    assert p.decode(ok.encode()).blocks == [6, 2]
    for blocks, why in [([4, 3], "sum to 7"), ([8, 0], "at least one"), ([8], "name 1 agents")]:
        bad = p.LaunchJob(job_id="j1", script="/s.py", func=None, workers=8, devices=2, placements=[],
                          master_addr="", master_port=0, blocks=blocks)
        with pytest.raises(p.ProtocolError, match=why):
            p.decode(bad.encode())
    with pytest.raises(p.ProtocolError, match="name 3 agents"):
        p.decode(p.ResizeJob(job_id="j1", devices=2, blocks=[1, 1, 6]).encode())
    hello = p.NodeHello(node_id="n", host="h", devices=[p.DeviceInfo(device_id="cpu:0", type="cpu", index=0,
                                                                     speed=-1.0)])
    with pytest.raises(p.ProtocolError, match="speed must be"):
        p.decode(hello.encode())


# --- placement at launch ----------------------------------------------------------------------------


def hello_with_speeds(isl: Island, node: str, speeds: list[float]) -> None:
    devs = [p.DeviceInfo(device_id=f"cpu:{i}", type="cpu", index=i, speed=s) for i, s in enumerate(speeds)]
    isl._take(isl.s.node_hello(p.NodeHello(node_id=node, host=f"{node}.host", devices=devs), isl.now))


def test_equal_unmeasured_devices_launch_with_the_uniform_layout_of_before():
    isl = Island()
    isl.hello("a", 2)
    job, out = isl.submit(workers=8, lo=2, hi=2)
    ((_, launch),) = launches(out)
    assert launch.blocks == [] and isl.s.jobs[job].blocks == []
    lay = isl.s.status(job, isl.now).jobs[0].layout
    assert [a.workers for a in lay.agents] == [4, 4] and [a.speed for a in lay.agents] == [1.0, 1.0]
    assert all(a.worker_step_s is None for a in lay.agents)


def test_declared_speeds_give_the_faster_device_more_workers_at_launch():
    isl = Island()
    hello_with_speeds(isl, "a", [1.0, 0.5])
    job, out = isl.submit(workers=8, lo=2, hi=2)
    ((_, launch),) = launches(out)
    assert sum(launch.blocks) == 8 and launch.blocks[0] > launch.blocks[1]
    assert isl.s.jobs[job].blocks == launch.blocks
    (node,) = isl.s.status(None, isl.now).nodes
    assert node.speeds == {"cpu:0": 1.0, "cpu:1": 0.5}
    assert "SPEEDS" in render(isl.s.status(None, isl.now)) and "1.00,0.50" in render(isl.s.status(None, isl.now))


# --- live re-layout -----------------------------------------------------------------------------------


class Timings:
    """Agents' step timings as the daemon reports them: numbered, one new round per call."""

    def __init__(self) -> None:
        self.seq = 0

    def round(self, per_worker: list[float], blocks: list[int], flush: float = 0.002, **kw) -> list[p.AgentReport]:
        self.seq += 1
        slowest = max(n * c for n, c in zip(blocks, per_worker, strict=True))
        return [agent(r, r, timing={"hosted": n, "compute_s": n * c, "steps": 5, "seq": self.seq,
                                    "flush_s": flush + slowest - n * c}, **kw)
                for r, (n, c) in enumerate(zip(blocks, per_worker, strict=True))]


def run_two_device_job(isl: Island) -> str:
    isl.hello("a", 2)
    job, out = isl.submit(workers=8, lo=2, hi=2)
    assert launches(out)
    isl.report("a", report(job, [agent(0, 0), agent(1, 1)], master_port=1234,
                           metrics={"total_steps": 1000}, step=1))
    assert isl.state(job) is JobState.RUNNING
    return job


def relayout_until_prepared(isl: Island, job: str, t: Timings, per_worker: list[float], rounds: int = 12):
    blocks = uniform(8, 2) if not isl.s.jobs[job].blocks else isl.s.jobs[job].blocks
    for i in range(rounds):
        isl.now += 1.0
        out = isl.report("a", report(job, t.round(per_worker, blocks), metrics={"total_steps": 1000},
                                     step=10 + i, steps_per_s=5.0))
        out += isl.tick(0.01)
        preps = of(out, p.PrepareResize)
        if preps:
            return i, preps
    return rounds, []


def complete(isl: Island, job: str, epoch: int) -> p.ResizeJob:
    out = isl.report("a", report(job, [agent(0, 0), agent(1, 1)], resize_epoch=epoch, resize_port=777,
                                 metrics={"total_steps": 1000}))
    ((_, go),) = of(out, p.ResizeJob)
    isl.report("a", report(job, [agent(0, 0, epoch=epoch, stepped=epoch), agent(1, 1, epoch=epoch)],
                           resize_epoch=epoch, metrics={"total_steps": 1000}, steps_per_s=5.0))
    assert isl.state(job) is JobState.RUNNING
    return go


def test_a_straggler_is_learned_and_the_job_re_laid_out_live_then_back_when_it_goes_away():
    isl = Island()
    job = run_two_device_job(isl)
    t = Timings()
    # Device 1 takes twice as long per logical worker-step.
    rounds, preps = relayout_until_prepared(isl, job, t, [0.01, 0.02])
    ((node, prep),) = preps
    assert rounds >= 2   # the gate's patience: not on the first measurement
    assert node == "a" and prep.devices == prep.devices_from == 2 and prep.joiners == []
    assert sum(prep.blocks) == 8 and prep.blocks[0] > prep.blocks[1]
    k0, k1 = device_key("a", "cpu:0"), device_key("a", "cpu:1")
    ratio = isl.s.speeds.costs.speed(k0) / isl.s.speeds.costs.speed(k1)
    assert 1.6 < ratio < 2.5
    go = complete(isl, job, 1)
    assert go.devices == 2 and go.blocks == prep.blocks
    j = isl.s.jobs[job]
    assert j.blocks == prep.blocks and j.placement == [["a", "cpu:0"], ["a", "cpu:1"]]
    (entry,) = j.resizes
    assert entry.outcome == "done" and entry.src == entry.dst == 2
    assert entry.blocks_from == [4, 4] and entry.blocks_to == prep.blocks
    assert 0.1 <= entry.predicted_gain < 0.5 and "speeds drifted" in entry.reason
    assert 0 < entry.predicted_s < entry.predicted_from_s   # the model's step times, kept in the history
    info = isl.s.status(job, isl.now).jobs[0]
    assert info.blocks == prep.blocks and info.layout.measured_step_s == pytest.approx(0.2)
    assert info.layout.predicted_step_s > 0
    text = render_job(info)
    assert f"layout     blocks {prep.blocks[0]}/{prep.blocks[1]}; step predicted" in text and "measured 0.2000s" in text
    assert "re-layout blocks 4/4 -> " in text and "a/cpu:1" in text and "per worker-step" in text
    # The same speeds under the new layout: nothing more to gain, so no oscillation however long it runs.
    rounds, preps = relayout_until_prepared(isl, job, t, [0.01, 0.02], rounds=40)
    assert preps == [] and len(j.resizes) == 1
    # The straggler goes away: after the cooldown the job goes back to the uniform layout.
    isl.now += 31
    rounds, preps = relayout_until_prepared(isl, job, t, [0.01, 0.01], rounds=40)
    ((_, prep2),) = preps
    assert prep2.blocks == []   # uniform, spelled as before
    go2 = complete(isl, job, 2)
    assert go2.blocks == [] and j.blocks == [] and j.resizes[-1].blocks_to == [4, 4]


def test_a_re_layout_that_fails_half_way_falls_back_on_the_old_blocks_unpinned():
    isl = Island()
    job = run_two_device_job(isl)
    _, preps = relayout_until_prepared(isl, job, Timings(), [0.01, 0.03])
    assert preps
    isl.report("a", report(job, [agent(0, 0), agent(1, 1)], resize_epoch=1, resize_port=777,
                           metrics={"total_steps": 1000}))
    isl.report("a", report(job, [agent(0, 0, alive=False), agent(1, 1, alive=False)], state="ended", ok=False,
                           error={"message": "agent 1 died", "cause": "died"}, snapshot_epoch=1,
                           snapshot_parts=[-1, *range(8)]))
    j = isl.s.jobs[job]
    assert j.resize is None and j.blocks == [] and j.requested_devices is None
    assert j.resizes[-1].outcome == "rolled back" and j.resizes[-1].predicted_gain is not None
    restart = [m for _n, m in of(isl.sent, p.LaunchJob)][-1]
    assert restart.blocks == [] and restart.restore_epoch == 1


def test_a_re_layout_its_agents_refuse_is_not_tried_again():
    isl = Island()
    job = run_two_device_job(isl)
    t = Timings()
    _, preps = relayout_until_prepared(isl, job, t, [0.01, 0.03])
    assert preps
    out = isl.report("a", report(job, [agent(0, 0), agent(1, 1)], resize_epoch=1, resize_port=777,
                                 metrics={"total_steps": 1000}))
    assert of(out, p.ResizeJob)
    isl.report("a", report(job, [agent(0, 0), agent(1, 1)], resize_epoch=1, metrics={"total_steps": 1000},
                           resize_error={"message": "cannot carry `w`", "refused": True, "step": 20}))
    j = isl.s.jobs[job]
    assert j.state is JobState.RUNNING and j.blocks == [] and j.resizes[-1].outcome == "refused"
    assert j.requested_devices is None   # a re-layout pins no size
    isl.now += 31   # past the gate's cooldown
    _, preps = relayout_until_prepared(isl, job, t, [0.01, 0.03], rounds=40)
    assert preps == [] and len(j.resizes) == 1


def test_the_model_and_gate_survive_a_scheduler_restart(tmp_path):
    isl = Island()
    job = run_two_device_job(isl)
    relayout_until_prepared(isl, job, Timings(), [0.01, 0.02], rounds=2)
    store = JobStore(tmp_path / "jobs.db")
    assert store.load_speeds() == {}
    store.save_speeds(isl.s.speeds.to_dict())
    again = Speeds.from_dict(JobStore(tmp_path / "jobs.db").load_speeds())
    for key in (device_key("a", "cpu:0"), device_key("a", "cpu:1")):
        assert again.costs.speed(key) == pytest.approx(isl.s.speeds.costs.speed(key))
    store._db.execute("UPDATE meta SET value='{not json' WHERE key='speeds'")
    assert store.load_speeds() == {}   # learned again, the scheduler still starts


# --- the daemon's half ------------------------------------------------------------------------------


def test_daemon_passes_blocks_to_agents_and_numbers_their_timings():
    sup = Supervision(cpu_devices(2))
    launch = p.LaunchJob(job_id="j1", script="/s.py", func=None, workers=8, devices=2, master_addr="h",
                         master_port=5, blocks=[6, 2],
                         placements=[p.RankPlacement(rank=0, device_id="cpu:0"),
                                     p.RankPlacement(rank=1, device_id="cpu:1")])
    spawns = sup.launch(launch, 5)
    assert [s.blocks for s in spawns if isinstance(s, Spawn)] == [[6, 2], [6, 2]]
    for i, s in enumerate(spawns):
        sup.started(s, 100 + i, "t")
        assert sup.agent_message(b"id%d" % i, p.AgentHello(job_id="j1", rank=i, info=p.AgentInfo(
            world=2, hosted=[0], pid=100 + i, host="h", device="cpu"), token="t"), 0.0)[0] is None
    one = {"hosted": 6, "compute_s": 0.06, "flush_s": 0.001, "steps": 1}
    sup.agent_message(b"id0", p.AgentStep(job_id="j1", rank=0, step=3, timing=one), 1.0)
    sup.agent_message(b"id0", p.AgentStep(job_id="j1", rank=0, step=4, timing={**one, "compute_s": 0.09}), 1.1)
    (rep,) = sup.reports({})
    assert rep.agents[0].timing == {}   # two steps: not enough to learn from yet
    sup.agent_message(b"id0", p.AgentStep(job_id="j1", rank=0, step=5, timing={**one, "steps": 2}), 1.2)
    sup.agent_message(b"id0", p.AgentStep(job_id="j1", rank=0, step=6, timing={"hosted": -1}), 1.3)   # ignored
    (rep,) = sup.reports({})
    assert rep.agents[0].timing == {"hosted": 6, "compute_s": pytest.approx(0.0675), "flush_s": pytest.approx(0.001),
                                    "steps": 4, "seq": 1} and rep.agents[1].timing == {}
    out = sup.go(p.ResizeJob(job_id="j1", devices=2, epoch=1, master_addr="h", master_port=6, devices_from=2,
                             blocks=[5, 3]))
    cmds = [a.msg for a in out if isinstance(a, AgentSend)]
    assert len(cmds) == 2 and all(isinstance(c, p.AgentResize) and c.blocks == [5, 3] for c in cmds)
    assert all(a.exitcode is None for a in sup.jobs["j1"].agents.values())   # a re-layout: nobody leaves


def test_start_refuses_a_bad_device_speed_with_a_clear_error(tmp_path):
    r = cli("start", "--state-dir", str(tmp_path / "a"), "--cpu-devices", "2", "--bind", "none",
            "--device-speed", "0=fast")
    assert r.code == 2 and "'fast' is not a number" in r.err
    r = cli("start", "--state-dir", str(tmp_path / "b"), "--cpu-devices", "2", "--bind", "none",
            "--device-speed", "2=0.5")
    assert r.code == 1 and "names device(s) [2]; this node has devices 0,1" in r.err


def test_timings_no_agent_would_send_are_skipped_not_raised_on():
    isl = Island()
    job = run_two_device_job(isl)
    bad = [{"hosted": 4, "compute_s": float("inf"), "flush_s": 0.0, "steps": 3, "seq": 1},
           {"hosted": 4, "compute_s": 0.04, "flush_s": float("nan"), "steps": 3, "seq": 2},
           {"hosted": 0, "compute_s": 0.04, "flush_s": 0.0, "steps": 3, "seq": 3},
           {"hosted": 4, "compute_s": "fast", "flush_s": 0.0, "steps": 3, "seq": 4}]
    for t in bad:
        isl.report("a", report(job, [agent(0, 0, timing=t), agent(1, 1)], metrics={"total_steps": 1000}))
    assert isl.s.speeds.costs.worker_step_seconds(device_key("a", "cpu:0"), job) == pytest.approx(0.01)


def test_a_device_learned_slow_by_a_finished_job_is_grown_onto_once_its_slowdown_expires():
    """What a short job on loaded shared cores taught: one of the devices it frees is 2.2x slower (scheduling
    noise). The preempted job does not grow back onto it (no shorter step predicted) until that device has
    been silent for the model's stale_s; then it does, at the next tick."""
    from island_core import complete as complete_resize
    from island_core import running_job

    isl = Island()
    isl.hello("a", 4)
    low = running_job(isl, workers=4, lo=1, hi=4)
    high, out = isl.submit(workers=2, lo=2, hi=2, prio=5)
    complete_resize(isl, "a", low, 1, 2, 4)
    isl.report("a", report(high, [agent(0, 2), agent(1, 3)], master_port=9))
    for seq in range(1, 5):
        isl.now += 0.1
        isl.report("a", report(high, [agent(r, 2 + r, timing={"hosted": 1, "compute_s": c, "steps": 5, "seq": seq,
                                                              "flush_s": 0.001})
                                      for r, c in ((0, 0.010), (1, 0.022))], step=seq))
    assert isl.s.speeds.speed("a", "cpu:3") < 0.5
    out = isl.report("a", report(high, [agent(0, 2, False), agent(1, 3, False)], state="ended"))
    assert isl.state(high) is JobState.FINISHED and of(out, p.PrepareResize) == []
    silent_since, stale = isl.now, isl.s.speeds.costs.stale_s
    preps: list = []
    while not preps and isl.now - silent_since < 2 * stale:   # heartbeats go on (the low job's agents), every 10 s
        isl.now += 10
        out = isl.report("a", report(low, [agent(0, 0), agent(1, 1)]))
        preps = of(out + isl.tick(0), p.PrepareResize)
        assert preps == [] or isl.now - silent_since >= stale
    ((_, prep),) = preps
    assert isl.now - silent_since < stale + 10
    assert prep.job_id == low and prep.devices == 4 and isl.s.speeds.speed("a", "cpu:3") == 1.0
    assert isl.s.jobs[low].resize.why == "policy: grow into freed devices"

