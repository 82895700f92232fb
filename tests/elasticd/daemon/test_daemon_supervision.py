"""The node's agent supervision core (elasticd/daemon/supervision.py, resizing.py) driven by hand.

No processes, sockets or clocks: pids are made up, `now` is passed in, and what the core asks for
comes back as actions to check. tests/elasticd/daemon/test_daemon_processes.py runs the I/O shell with real processes.
"""

from __future__ import annotations

import ast

import pytest
from node_core import ERR, T0, Node, hello_info, launch_msg, running, token_of
from util import REPO

from elasticd import protocol as p
from elasticd.core.failures import Cause
from elasticd.daemon import resizing, supervision
from elasticd.daemon.actions import DropSnapshots, Report, Signal


def resized(epoch: int | None, rank: int, left: bool = False) -> p.ResizedInfo:
    return p.ResizedInfo(epoch=epoch, world=2, rank=rank, left=left, seconds=0.1, blocks="")


def signals(actions) -> list[tuple[int, str]]:
    return [(a.pid, a.sig) for a in actions if isinstance(a, Signal)]


def test_launch_spawns_each_rank_and_is_running_once_all_said_hello():
    node = Node()
    spawns = node.core.launch(launch_msg("j", restore_epoch=3), port=29500)
    assert [(s.rank, s.device_id, s.master_addr, s.master_port, s.standby, s.restore_epoch, s.error_name)
            for s in spawns] == [(0, "cpu:0", "10.0.0.1", 29500, False, 3, "rank0.json"),
                                 (1, "cpu:1", "10.0.0.1", 29500, False, 3, "rank1.json")]
    node.start(spawns)
    assert node.report("j").state == "launching" and node.core.busy_devices() == {"cpu:0", "cpu:1"}
    node.hello("j", 0)
    assert node.report("j").state == "launching"
    node.hello("j", 1)
    r = node.report("j")
    assert r.state == "running" and r.master_port == 29500 and [a.pid for a in r.agents] == [100, 101]


def test_a_repeated_launch_is_ignored_and_one_after_the_end_starts_afresh():
    node = Node()
    running(node)
    assert node.core.launch(launch_msg("j"), port=1) == []
    assert [a.pid for a in node.report("j").agents] == [100, 101]
    assert node.exit("j", 0, 0) == [] and node.exit("j", 1, 0) == [Report()]
    assert node.report("j").state == "ended" and node.report("j").ok
    assert len(node.core.launch(launch_msg("j"), port=2)) == 2 and node.report("j").agents == []


def test_a_launch_on_an_unknown_device_is_refused_with_a_reason():
    node = Node(devices=1)
    assert node.core.launch(launch_msg("j", ranks=2), port=1) == []
    r = node.report("j")
    assert r.state == "ended" and not r.ok and "cpu:1" in r.error["message"]


def test_an_agent_that_cannot_start_fails_the_launch_and_stops_the_started_ones():
    node = Node()
    rest = node.start(node.core.launch(launch_msg("j", ranks=3), port=1), fail_rank=1)
    assert signals(rest) == [(100, "TERM")]             # rank 2 was never started
    r = node.report("j")
    assert r.ranks == [0] and "cannot start agent 1: no such file" in r.error["message"]
    assert signals(node.core.tick(T0 + supervision.TERM_GRACE_S)) == [(100, "KILL")]


def test_an_agent_that_said_done_is_not_sigtermed_while_it_exits():
    node = Node()
    idents = running(node)
    node.core.kill("j", "user", T0)
    err, _ = node.core.agent_message(idents[0], p.AgentDone(job_id="j", rank=0), T0 + 1)
    assert err is None
    assert signals(node.core.tick(T0 + supervision.STOP_GRACE_S)) == [(101, "TERM")]
    # Still there once the kill deadline comes: a done agent stuck on its way out is not left running.
    assert signals(node.core.tick(T0 + supervision.STOP_GRACE_S + supervision.TERM_GRACE_S)) == [
        (100, "KILL"), (101, "KILL")]


def test_stop_escalates_from_a_command_to_sigterm_to_sigkill():
    node = Node()
    idents = running(node)
    stops = node.core.kill("j", "user", T0)
    assert [(a.identity, a.msg) for a in stops] == [(i, p.AgentStop()) for i in idents]
    assert node.core.kill("j", "again", T0) == []        # once is enough
    assert node.core.tick(T0 + supervision.STOP_GRACE_S - 0.1) == []
    assert signals(node.core.tick(T0 + supervision.STOP_GRACE_S)) == [(100, "TERM"), (101, "TERM")]
    node.exit("j", 0, -15)
    assert signals(node.core.tick(T0 + supervision.STOP_GRACE_S + supervision.TERM_GRACE_S)) == [(101, "KILL")]
    assert node.exit("j", 1, -9) == [Report()]
    r = node.report("j")
    assert r.state == "ended" and not r.ok and node.core.kill("j", "late", T0 + 60) == []


def test_a_failing_agent_reports_its_error_and_its_siblings_are_terminated_at_once():
    node = Node()
    running(node)
    assert signals(node.exit("j", 1, 1, now=T0 + 2)) == [(100, "TERM")]
    assert node.report("j").error == {**ERR, "rank": 1}
    assert node.exit("j", 0, -15) == [Report()]
    assert not node.report("j").ok


def test_agent_messages_are_checked_against_the_agent_that_said_hello():
    node = Node()
    node.start(node.core.launch(launch_msg("j"), port=1))
    msg = node.core.agent_message
    assert "no agent 5" in msg(b"x", p.AgentHello(job_id="j", rank=5, info=hello_info(1)), T0)[0]
    assert "is pid 100, not 7" in msg(b"x", p.AgentHello(job_id="j", rank=0, info=hello_info(7)), T0)[0]
    # Another job's process knows the rank and the pid (/proc shows them), not the agent's token.
    for token in ("", "0" * 32, token_of(101)):
        assert "wrong token" in msg(b"x", p.AgentHello(job_id="j", rank=0, info=hello_info(100), token=token), T0)[0]
    assert msg(b"x", p.AgentStep(job_id="j", rank=0, step=1), T0)[0] == "say agent_hello first"
    ident = node.hello("j", 0)
    assert "this connection is agent 0" in msg(ident, p.AgentStep(job_id="j", rank=1, step=1), T0)[0]
    assert "this connection is agent 0" in msg(ident, p.AgentStop(), T0)[0]   # a command, not an agent's message
    assert msg(ident, p.AgentDone(job_id="j", rank=0), T0) == (None, [])
    for step in (1, 2, 3):
        assert msg(ident, p.AgentStep(job_id="j", rank=0, step=step, metrics={"loss": 0.5}), T0 + step) == (None, [])
    r = node.report("j")
    assert r.step == 3 and r.steps_per_s == 1.0 and r.metrics == {"loss": 0.5}
    failed = p.AgentError(message="ValueError: boom", traceback="Traceback ...", logical_rank=0, host="h")
    assert msg(ident, p.AgentFailed(job_id="j", rank=0, error=failed), T0) == (None, [])
    assert node.report("j").error == failed.as_dict("j", 0)


def test_a_held_step_of_the_lead_agent_is_reported_to_the_scheduler_at_once():
    """The agents stop after a --scale-at step and wait; the scheduler starts the resize when it hears of the
    step, so that report cannot wait for the next heartbeat. Other steps, and another agent's, do."""
    node = Node()
    node.start(node.core.launch(launch_msg("j", hold_at=[10, 20]), port=1))
    lead, other = node.hello("j", 0), node.hello("j", 1)
    msg = node.core.agent_message
    assert msg(lead, p.AgentStep(job_id="j", rank=0, step=9), T0) == (None, [])
    assert msg(other, p.AgentStep(job_id="j", rank=1, step=10), T0) == (None, [])
    assert msg(lead, p.AgentStep(job_id="j", rank=0, step=10), T0) == (None, [Report()])
    assert msg(lead, p.AgentStep(job_id="j", rank=0, step=11), T0) == (None, [])


def test_usage_is_kept_for_the_jobs_own_agents():
    node = Node()
    running(node)
    node.core.sampled(100, rss=1 << 20, cpu=55.56)
    node.core.sampled(999, rss=1, cpu=1.0)                # not ours: ignored
    a = node.report("j").agents[0]
    assert (a.rss, a.cpu) == (1 << 20, 55.6)


def test_forget_drops_ended_jobs_and_all_their_snapshots():
    node = Node()
    running(node, "a")
    running(node, "b")
    node.exit("a", 0, 0)
    node.exit("a", 1, 0)
    assert node.core.forget(["a", "b", "nobody"]) == [DropSnapshots("a", None)]
    assert sorted(node.core.jobs) == ["b"]


def test_a_first_step_after_a_restore_drops_the_snapshot_it_started_from():
    node = Node()
    node.start(node.core.launch(launch_msg("j", restore_epoch=2), port=1))
    ident = node.hello("j", 0)
    step = p.AgentStep(job_id="j", rank=0, step=5)
    assert node.core.agent_message(ident, step, T0) == (None, [DropSnapshots("j", 2)])
    assert node.core.agent_message(ident, step, T0) == (None, [])


# --- live resize (elasticd/daemon/resizing.py) -------------------------------------------------------

def prepare_msg(job: str = "j", epoch: int = 1, joiners=((2, "cpu:2"), (3, "cpu:3")), **kw) -> p.PrepareResize:
    return p.PrepareResize(job_id=job, epoch=epoch, devices_from=2, devices=2 + len(joiners),
                           joiners=[p.RankPlacement(rank=r, device_id=d) for r, d in joiners], script="/s.py",
                           workers=4, **kw)


def test_joiners_on_a_node_new_to_the_job_run_as_the_jobs_user_with_its_options():
    # The node knows the job only from the prepare: its agents must start as the job says, not as the
    # node's default user.
    node = Node()
    spawns = node.core.prepare(prepare_msg("k", run_as="alice", threads=2, stuck_after="90s"), port=0)
    assert [(s.rank, s.standby) for s in spawns] == [(2, True), (3, True)]
    launch = spawns[0].launch
    assert (launch.run_as, launch.threads, launch.stuck_after, launch.script) == ("alice", 2, "90s", "/s.py")


def test_a_move_across_islands_tells_running_agents_and_joiners_the_new_islands():
    node = Node()
    idents = running(node)
    node.start(node.core.prepare(prepare_msg(snapshot_key="k1"), port=0))
    joiners = [node.hello("j", 2), node.hello("j", 3)]
    go = node.core.go(p.ResizeJob(job_id="j", devices=4, epoch=1, master_addr="h", master_port=29600, devices_from=2,
                                  islands=[2, 2]))
    assert [(a.identity, a.msg.islands) for a in go] == [(i, [2, 2]) for i in [*idents, *joiners]]
    # A portion joining on a node new to it: the resize snapshots it drops live under its job's key, where
    # its agents write them.
    node.start(node.core.prepare(prepare_msg("k", joiners=((2, "cpu:2"),), snapshot_key="k1"), port=0))
    ident = node.hello("k", 2)
    node.core.go(p.ResizeJob(job_id="k", devices=3, epoch=1, master_addr="h", master_port=1, devices_from=2))
    node.core.agent_message(ident, p.AgentResized(job_id="k", rank=2, info=resized(None, 2)), T0)
    _err, actions = node.core.agent_message(ident, p.AgentStep(job_id="k", rank=2, step=5), T0)
    assert DropSnapshots("k", 1, under_key="k1") in actions


def test_a_grow_starts_warm_joiners_then_tells_everyone_and_ends_at_the_first_step():
    node = Node()
    idents = running(node)
    spawns = node.core.prepare(prepare_msg(pick_port=True), port=29600)
    assert [(s.rank, s.device_id, s.standby, s.error_name, s.restore_epoch) for s in spawns] == [
        (2, "cpu:2", True, "rank2-e1.json", 0), (3, "cpu:3", True, "rank3-e1.json", 0)]
    node.start(spawns)
    assert node.core.prepare(prepare_msg(pick_port=True), port=1) == []   # repeated
    r = node.report("j")
    assert r.resize_port == 29600 and r.state == "running" and [a.standby for a in r.agents] == [0, 0, 1, 1]
    joiners = [node.hello("j", 2), node.hello("j", 3)]
    go = node.core.go(p.ResizeJob(job_id="j", devices=4, epoch=1, master_addr="h", master_port=29600, devices_from=2))
    resize = p.AgentResize(epoch=1, world=4, master_addr="h", master_port=29600)
    assert [(a.identity, a.msg) for a in go] == [
        (idents[0], resize), (idents[1], resize),
        # Each joiner is told the device it was started for (cpu:2, cpu:3): the node's table names it.
        *[(j, p.AgentJoin(rank=r, world=4, join_from=2, master_addr="h", master_port=29600, device_index=r))
          for r, j in zip((2, 3), joiners, strict=True)]]
    for rank, ident in enumerate([*idents, *joiners]):
        info = resized(1 if rank < 2 else None, rank)           # a joiner does not know the epoch
        assert node.core.agent_message(ident, p.AgentResized(job_id="j", rank=rank, info=info), T0) == (None, [Report()])
    assert [r.epoch for r in node.report("j").resizes] == [1]
    step = p.AgentStep(job_id="j", rank=3, step=9)
    assert node.core.agent_message(joiners[1], step, T0) == (None, [Report(), DropSnapshots("j", 1)])
    assert [(a.epoch, a.stepped) for a in node.report("j").agents] == [(1, 0), (1, 0), (1, 0), (1, 1)]


def test_a_shrink_retires_the_leaving_agents_until_they_are_gone():
    node = Node()
    idents = running(node, ranks=4)
    go = node.core.go(p.ResizeJob(job_id="j", devices=2, epoch=1, master_addr="h", master_port=1, devices_from=4))
    assert [a.identity for a in go] == idents
    for rank in (2, 3):
        node.core.agent_message(idents[rank], p.AgentResized(job_id="j", rank=rank, info=resized(1, rank, left=True)),
                                T0)
    r = node.report("j")
    assert r.ranks == [0, 1] and [a.left for a in r.agents] == [False, False, True, True] and r.resizes == []
    assert node.exit("j", 2, 0) == [] and node.core.tick(T0) == [Report()]
    r = node.report("j")
    assert [a.rank for a in r.agents] == [0, 1, 3] and r.state == "running" and r.error is None
    assert node.core.busy_devices() == {"cpu:0", "cpu:1", "cpu:3"}


def test_a_shrink_before_a_scheduled_grow_keeps_its_leavers_warm_and_the_grow_takes_them():
    """ResizeJob.standby (the job's --scale-at grows again later): the agents that leave stay, reported warm
    so that the scheduler frees their devices at once; the grow's joiners on this node are taken from them,
    ready at once, under their new ranks and devices; one no grow took is sent away when the job's own
    agents end, and its exit is no failure."""
    node = Node()
    idents = running(node, ranks=4)
    go = node.core.go(p.ResizeJob(job_id="j", devices=2, epoch=1, master_addr="h", master_port=1, devices_from=4,
                                  standby=True))
    leave = p.AgentResize(epoch=1, world=2, master_addr="h", master_port=1, standby=True)
    assert [(a.identity, a.msg) for a in go] == [(i, leave) for i in idents]
    for rank in (2, 3):
        node.core.agent_message(idents[rank], p.AgentResized(job_id="j", rank=rank, info=resized(1, rank, left=True)),
                                T0)
    r = node.report("j")
    assert r.ranks == [0, 1] and r.state == "running"
    assert [(a.rank, a.left, a.warm, a.alive) for a in r.agents] == [
        (0, False, False, True), (1, False, False, True), (2, True, True, True), (3, True, True, True)]
    # The grow places one joiner here, rank 2 on cpu:3: the first agent kept warm takes it, no process starts.
    assert node.core.prepare(prepare_msg(epoch=2, joiners=((2, "cpu:3"),)), port=0) == [Report()]
    r = node.report("j")
    assert [(a.rank, a.pid, a.device_id, a.standby, a.warm, a.left, a.connected) for a in r.agents] == [
        (0, 100, "cpu:0", False, False, False, True), (1, 101, "cpu:1", False, False, False, True),
        (2, 102, "cpu:3", True, False, False, True), (3, 103, "cpu:3", False, True, True, True)]
    go = node.core.go(p.ResizeJob(job_id="j", devices=3, epoch=2, master_addr="h", master_port=2, devices_from=2,
                                  standby=False))
    assert [(a.identity, a.msg) for a in go][-1] == (idents[2], p.AgentJoin(
        rank=2, world=3, join_from=2, master_addr="h", master_port=2, device_index=3))
    joined = p.AgentResized(job_id="j", rank=2, info=resized(None, 2))
    assert node.core.agent_message(idents[2], joined, T0) == (None, [Report()])
    assert node.report("j").ranks == [0, 1, 2]
    for rank in (0, 1, 2):
        node.exit("j", rank, 0)
    assert signals(node.core.tick(T0)) == [(103, "TERM")]   # the one no grow took
    node.exit("j", 3, -15)
    r = node.report("j")
    assert r.state == "ended" and r.ok and r.error is None


def test_a_joiner_dying_before_the_go_fails_the_resize_not_the_job():
    node = Node()
    running(node)
    node.start(node.core.prepare(prepare_msg(), port=0))
    assert node.exit("j", 2, 1) == [Report()]
    r = node.report("j")
    assert r.error is None and r.resize_error == {**ERR, "rank": 2} and r.ranks == [0, 1, 3]


def test_a_joiner_that_cannot_start_fails_the_resize_and_no_later_joiner_starts():
    node = Node()
    running(node)
    assert node.start(node.core.prepare(prepare_msg(), port=0), fail_rank=2) == []
    r = node.report("j")
    assert r.resize_error == {"message": "cannot start joining agent 2: no such file"} and r.ranks == [0, 1]
    bad = node.core.prepare(prepare_msg(epoch=2, joiners=((1, "cpu:2"),)), port=0)
    assert bad == [] and "rank still taken" in node.report("j").resize_error["message"]
    assert node.core.prepare(prepare_msg(epoch=3, joiners=((2, "cpu:9"),)), port=0) == []
    assert "no such device" in node.report("j").resize_error["message"]


def test_an_aborted_resize_sends_the_joiners_away_and_kills_those_that_stay():
    node = Node()
    running(node)
    node.start(node.core.prepare(prepare_msg(), port=0))
    out = node.core.abort(p.AbortResize(job_id="j", epoch=1, reason="test"), T0)
    assert signals(out) == [(102, "TERM"), (103, "TERM")] and Report() in out
    node.exit("j", 2, -15)                               # a joiner sent away: its exit is no failure
    assert signals(node.core.tick(T0 + resizing.DROP_GRACE_S)) == [(103, "KILL")]
    node.exit("j", 3, -9)
    node.core.tick(T0 + resizing.DROP_GRACE_S)
    r = node.report("j")
    assert r.ranks == [0, 1] and r.error is None and r.resize_error is None and len(r.agents) == 2


def refuse(node: Node, ident: bytes, rank: int) -> None:
    info = p.RefusedInfo(epoch=1, step=6, message="cannot carry `w` in train() across the resize", by=0)
    assert node.core.agent_message(ident, p.AgentResizeRefused(job_id="j", rank=rank, info=info), T0) == (
        None, [Report()])


def test_a_grow_its_agents_refuse_sends_the_joiners_away_and_leaves_the_job_as_it_was():
    node = Node()
    idents = running(node)
    node.start(node.core.prepare(prepare_msg(), port=0))
    joiners = [node.hello("j", 2), node.hello("j", 3)]
    node.core.go(p.ResizeJob(job_id="j", devices=4, epoch=1, master_addr="h", master_port=1, devices_from=2))
    refuse(node, idents[0], 0)
    refuse(node, idents[1], 1)
    assert node.report("j").resize_error == {"message": "cannot carry `w` in train() across the resize",
                                             "refused": True, "step": 6}
    out = node.core.abort(p.AbortResize(job_id="j", epoch=1, reason="refused"), T0)
    assert signals(out) == [(102, "TERM"), (103, "TERM")]
    node.exit("j", 2, -15)
    node.exit("j", 3, -15)
    node.core.tick(T0)
    r = node.report("j")
    assert r.ranks == [0, 1] and r.state == "running" and r.error is None and [a.pid for a in r.agents] == [100, 101]
    assert node.core.agent_message(joiners[0], p.AgentStep(job_id="j", rank=2, step=7), T0)[0] is not None


@pytest.mark.parametrize(("keep", "standby"), [([], False), ([], True), ([1, 3], False)],
                         ids=["shrink", "shrink-keeping-leavers-warm", "drain"])
def test_a_shrink_its_agents_refuse_keeps_every_agent_under_its_old_rank(keep, standby):
    node = Node()
    idents = running(node, ranks=4)
    node.core.go(p.ResizeJob(job_id="j", devices=2, epoch=1, master_addr="h", master_port=1, devices_from=4,
                             keep=keep, standby=standby))
    refuse(node, idents[0], 0)
    assert signals(node.core.abort(p.AbortResize(job_id="j", epoch=1, reason="refused"), T0)) == []
    r = node.report("j")
    assert r.ranks == [0, 1, 2, 3] and [a.rank for a in r.agents] == [0, 1, 2, 3]
    assert not any(a.warm for a in r.agents)
    assert [a.pid for a in r.agents] == [100, 101, 102, 103]
    for rank, ident in enumerate(idents):   # each speaks as its old rank, as before the go
        assert node.core.agent_message(ident, p.AgentStep(job_id="j", rank=rank, step=7), T0)[0] is None
    # the next resize's go starts clean: the refusal was the last one's
    node.core.go(p.ResizeJob(job_id="j", devices=2, epoch=2, master_addr="h", master_port=1, devices_from=4))
    assert node.report("j").resize_error is None and node.report("j").ranks == [0, 1]


def test_joiners_are_sent_away_when_the_job_ends_before_the_resize():
    node = Node()
    running(node)
    node.start(node.core.prepare(prepare_msg(joiners=((2, "cpu:2"),)), port=0))
    node.exit("j", 0, 0)
    node.exit("j", 1, 0)
    assert signals(node.core.tick(T0)) == [(102, "TERM")]
    assert node.report("j").state == "running"          # until the joiner is gone
    assert node.exit("j", 2, -15) == [Report()]
    r = node.report("j")
    assert r.state == "ended" and r.ok


def test_a_prepare_for_a_job_new_here_starts_its_joiners():
    node = Node()
    node.start(node.core.prepare(prepare_msg("k", joiners=((2, "cpu:0"),)), port=0))
    r = node.report("k")
    assert r.ranks == [2] and r.agents[0].standby and r.state == "running"


@pytest.mark.parametrize("module", ["supervision", "resizing", "records", "actions"])
def test_the_core_does_no_io(module):
    """What makes the core testable by hand: it imports nothing that reaches processes, files or clocks."""
    tree = ast.parse((REPO / "elasticd" / "daemon" / f"{module}.py").read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not imported & {"os", "subprocess", "signal", "psutil", "shutil", "socket", "time", "zmq", "pathlib"}


def test_the_agent_that_died_is_the_cause_even_when_a_survivor_is_reaped_first():
    """Agent 1 is SIGKILLed; agent 0 loses its group and exits first. The node reports agent 1's death, not
    agent 0's lost group; an exit by a signal the daemon itself sent while stopping the job never counts."""
    node = Node()
    running(node, ranks=3)
    lost = {"message": "PeerLost: a collective of the agents' group failed", "cause": "peer_lost"}
    node.core.exited(node.pid["j", 0], 75, lost, T0)
    assert node.report("j").error["cause"] == "peer_lost"
    node.core.tick(T0)   # the stop escalates: SIGTERM to the agents left
    node.core.exited(node.pid["j", 2], -15, {"message": "agent 2 was killed by SIGTERM", "cause": "died"}, T0)
    assert node.report("j").error["cause"] == "peer_lost", "our own SIGTERM is not the cause"
    died = {"message": "agent 1 was killed by SIGKILL and left no error report", "cause": "died"}
    node.core.exited(node.pid["j", 1], -9, died, T0)
    err = node.report("j").error
    assert err["cause"] == "died" and err["rank"] == 1 and "SIGKILL" in err["message"]


def test_the_agent_that_died_is_the_cause_even_when_a_survivor_said_so_first():
    """Agent 1 is SIGKILLed; agent 0 reports its lost group over the control socket before the daemon reaps
    agent 1. The node reports agent 1's death."""
    node = Node()
    idents = running(node)
    lost = p.AgentError(message="PeerLost: a collective of the agents' group failed", cause=Cause.PEER_LOST)
    assert node.core.agent_message(idents[0], p.AgentFailed(job_id="j", rank=0, error=lost), T0) == (None, [])
    assert node.report("j").error["cause"] == "peer_lost"
    died = {"message": "agent 1 was killed by SIGKILL and left no error report", "cause": "died"}
    node.core.exited(node.pid["j", 1], -9, died, T0)
    err = node.report("j").error
    assert err["cause"] == "died" and err["rank"] == 1 and "SIGKILL" in err["message"]
