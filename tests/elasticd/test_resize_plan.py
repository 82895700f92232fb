"""The resize decisions on their own (elasticd.resize_plan): events in with a hand-driven clock, actions out.

No sockets, threads or processes: what the scheduler and `elasticd run` do with the actions is tested
in test_resize_scheduler.py, test_run_resize.py and test_resize_daemon.py.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from elasticd.core.parts import GROUPS
from elasticd.resize_plan import Abort, Done, Fail, FallBack, Go, Refuse, ResizePlan, RollBack


def plan(src: int, dst: int, *, now: float = 100.0, timeout_s: float = 10.0) -> ResizePlan:
    placement = [["a", f"d{r}"] if r < 2 else ["b", f"d{r}"] for r in range(dst)]
    return ResizePlan.begin(epoch=3, src=src, dst=dst, why="test", now=now, placement=placement, step=7,
                            timeout_s=timeout_s)


def test_who_moves():
    grow, shrink = plan(1, 4), plan(3, 1)
    assert (grow.stayers, grow.joiners, grow.leavers) == ([0], [1, 2, 3], [])
    assert (shrink.stayers, shrink.joiners, shrink.leavers) == ([0], [], [1, 2])
    assert grow.joiners_on("a") == [1] and grow.joiners_on("b") == [2, 3] and grow.nodes() == ["a", "b"]
    with pytest.raises(ValueError):
        plan(2, 2)


def test_a_shrink_goes_as_soon_as_the_port_is_known():
    pl = plan(3, 1)
    assert pl.port_known(0, 100.5) == []          # no port yet: rank 0's node has not answered
    assert pl.port_known(5000, 101.0) == [Go()]
    assert pl.phase == "go" and pl.commanded_at == 101.0 and pl.deadline == 111.0
    assert pl.port_known(6000, 101.0) == [] and pl.port == 5000


def test_a_grow_goes_once_the_port_is_known_and_every_joiner_is_ready_in_any_order():
    pl = plan(1, 3)
    assert pl.joiner_ready(2, 100.1) == []
    assert pl.joiner_ready(0, 100.1) == []        # not a joiner
    assert pl.port_known(5000, 100.2) == []
    assert pl.joiner_ready(2, 100.3) == []        # said hello twice
    assert pl.joiner_ready(1, 100.4) == [Go()]
    assert pl.ready == [2, 1] and pl.commanded_at == 100.4


def test_a_grow_prepared_ahead_goes_once_the_job_is_at_its_step_and_counts_from_there():
    pl = ResizePlan.begin(epoch=3, src=1, dst=2, why="test", now=100.0, placement=[["a", "d0"], ["a", "d1"]],
                          step=7, timeout_s=10.0, after_step=20)
    assert pl.ahead
    assert pl.port_known(5000, 100.1) == [] and pl.joiner_ready(1, 100.2) == []   # warm, the job not there
    assert pl.tick(500.0, ["a"]) == []             # waiting for the step is not being late
    assert pl.reached(19, 501.0) == [] and pl.phase == "prepare"
    assert pl.reached(20, 502.0) == [Go()]
    assert (pl.step, pl.requested_at, pl.commanded_at, pl.ahead) == (20, 502.0, 502.0, False)
    assert pl.reached(21, 503.0) == []             # once


def test_a_grow_prepared_ahead_whose_step_comes_first_goes_when_its_joiners_are_ready_or_aborts_in_time():
    def ahead() -> ResizePlan:
        return ResizePlan.begin(epoch=3, src=1, dst=2, why="test", now=100.0, placement=[["a", "d0"], ["a", "d1"]],
                                step=7, timeout_s=10.0, after_step=20)
    pl = ahead()
    assert pl.port_known(5000, 100.1) == [] and pl.reached(20, 101.0) == []
    assert pl.joiner_ready(1, 101.5) == [Go()]
    late = ahead()
    late.reached(20, 101.0)
    assert late.tick(111.5, ["a"]) == [Abort("joining ranks [1] not ready within 10s")]
    dying = ahead()
    assert dying.agent_failed(100.5, {"message": "boom"}, joiner=True) == [Abort("boom")]


def test_done_when_rank_0_steps_after_every_new_rank_re_formed():
    pl = plan(1, 2)
    pl.port_known(5000, 100.0)
    pl.joiner_ready(1, 100.5)
    assert pl.stepped(101.0) == []                # a step still at the old size
    assert pl.reformed(0) and not pl.reformed(0)
    assert not pl.reformed(2)                     # not in the new layout
    assert pl.stepped(101.5) == []
    assert pl.reformed(1)
    assert pl.stepped(102.5, handover_s=0.25) == [Done(2.5)]
    assert pl.handover_s == 0.25


def test_a_joiner_dying_before_the_go_calls_the_resize_off_and_an_old_agent_is_the_jobs_own_failure():
    pl = plan(1, 2)
    assert pl.agent_failed(100.5, {"message": "ImportError"}, joiner=False) == []
    assert pl.agent_failed(100.5, {"message": "ImportError"}, joiner=True) == [Abort("ImportError")]


@pytest.mark.parametrize("ready, why", [([], "joining ranks [1, 2] not ready within 10s"),
                                        ([1, 2], "no rendezvous port from rank 0's node within 10s")])
def test_prepare_past_its_deadline_aborts(ready, why):
    pl = plan(1, 3)
    for r in ready:
        pl.joiner_ready(r, 101.0)
    assert pl.tick(110.0, ["a", "b"]) == []
    assert pl.tick(110.5, ["a", "b"]) == [Abort(why)]


def test_an_agent_dying_after_the_go_rolls_back_naming_the_resize():
    pl = plan(2, 1)
    pl.port_known(5000, 101.0)
    actions = pl.agent_failed(102.0, {"message": "agent 1 exited with code 3", "node": "a"}, joiner=False)
    err = {"message": "resize 3 (2 -> 1 devices, test) failed: agent 1 exited with code 3", "node": "a",
           "resize_epoch": 3}
    assert actions == [RollBack(err)]
    assert pl.phase == "rollback" and pl.failure == err and pl.deadline == 112.0
    assert pl.agent_failed(102.5, {"message": "another"}, joiner=False) == []   # already stopping everything


def test_go_past_its_deadline_rolls_back():
    pl = plan(1, 2)
    pl.port_known(5000, 100.0)
    pl.joiner_ready(1, 101.0)
    pl.reformed(0)
    (action,) = pl.tick(111.5, ["a", "b"])
    assert isinstance(action, RollBack) and "ranks [1] did not re-form within 10s" in action.error["message"]


def rolled_back(workers_saved: dict[str, list[int]]) -> ResizePlan:
    pl = plan(2, 3)
    pl.port_known(5000, 100.0)
    pl.joiner_ready(2, 100.0)
    for place, have in workers_saved.items():
        assert pl.note_saved(place, have)
    pl.agent_failed(101.0, {"message": "boom"}, joiner=False)
    return pl


def test_falls_back_once_every_place_is_gone_and_the_parts_cover_the_job():
    pl = rolled_back({"a": [GROUPS, 0, 1], "b": [2, 3]})
    assert not pl.note_saved("a", [GROUPS, 0, 1])
    assert pl.missing_parts(4) == []
    assert pl.place_gone("a") and not pl.place_gone("a")
    assert pl.settle(["a", "b"], 4) == []         # b's agents still run
    pl.place_gone("b")
    assert pl.settle(["a", "b"], 4) == [FallBack()]


@pytest.mark.parametrize("dead, what", [([], "its snapshot lacks the replicated state and logical rank(s) [3] "
                                             "(an agent died before saving it)"),
                                        (["a"], "nodes ['a'] of its layout are gone")])
def test_no_fall_back_without_a_whole_snapshot_or_with_a_node_gone(dead, what):
    pl = rolled_back({"a": [0, 1], "b": [2]} if not dead else {"a": [GROUPS, 0, 1], "b": [2, 3]})
    pl.place_gone("a")
    pl.place_gone("b")
    (action,) = pl.settle(["a", "b"], 4, dead)
    assert isinstance(action, Fail) and action.reason == "resize 3 failed"
    assert action.error["message"].endswith(f"failed: boom; no complete snapshot to fall back to: {what}")


def test_a_rollback_whose_agents_do_not_exit_in_time_fails():
    pl = rolled_back({})
    pl.place_gone("a")
    (action,) = pl.tick(111.5, ["a", "b"])
    assert isinstance(action, Fail) and action.reason == "resize 3 rollback timed out"
    assert "its agents on ['b'] did not exit within 10s" in action.error["message"]


def test_no_deadline_never_times_out_and_the_plan_is_plain_data():
    pl = plan(1, 2, timeout_s=math.inf)
    assert pl.tick(1e12, ["a"]) == []
    assert ResizePlan(**dataclasses.asdict(pl)) == pl   # what the scheduler persists is all there is


def test_a_refusal_by_the_agents_ends_the_plan_once_and_no_deadline_fails_it_afterwards():
    pl = plan(1, 2)
    pl.port_known(5000, 100.0)
    pl.joiner_ready(1, 100.5)
    assert pl.refused("cannot carry x") == [Refuse("cannot carry x")]
    assert pl.phase == "refused" and pl.reason() == "cannot carry x"
    assert pl.refused("again") == [] and pl.tick(1e9, ["a", "b"]) == []
    assert pl.agent_failed(200.0, {"message": "late"}, joiner=True) == [] and pl.stepped(200.0) == []
    held = plan(1, 2)   # `elasticd run`: refused at a held step while the joiners warm up
    assert held.refused("cannot carry y") == [Refuse("cannot carry y")]
    rolling = plan(3, 1)
    rolling.port_known(5000, 100.0)
    rolling.agent_failed(101.0, {"message": "died"}, joiner=False)
    assert rolling.refused("too late") == [] and rolling.phase == "rollback"
