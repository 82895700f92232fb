"""Live resize through a real node daemon (embedded scheduler), driven with the CLI.

Real agents (`python -m agent`) run tests/jobs/resize_job.py, paced: the job trains slowly until the test
releases it, so every resize surely lands mid-training, then finishes at full speed. The result must be
bitwise the result of `elasticd run` of the same job never resized, with every step and sample consumed
exactly once per logical rank. Failure paths (an agent dying mid-resize, a joiner that cannot start, a
job finishing before its joiners are warm) use tests/jobs/fake_agent.py, which speaks the same resize
protocol without torch.
"""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest
from cluster import status, wait_state
from daemon_jobs import FAKE_SCRIPT, JOB, STEPS, job_env, job_info, submit, wait_resized
from util import assert_same_run, cli, wait_until

from elasticd.statedir import StateDir


def assert_exactly_the_unscaled_run(out: Path, ref: Path) -> None:
    assert_same_run(out, ref, STEPS, ranks=4)


@pytest.fixture(scope="module")
def unscaled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`elasticd run` of the job on 4 devices, never resized (released from the start: no pacing)."""
    out = tmp_path_factory.mktemp("unscaled")
    (out / "release").touch()
    r = cli("run", JOB, "--devices", "4", env=job_env(out), timeout=600)
    assert r.code == 0, r.err[-3000:]
    return out


@pytest.mark.slow
def test_scale_4_2_1_4_while_training_is_bitwise_the_unscaled_run(cluster, tmp_path, unscaled):
    d = cluster.daemon(cpu=4, fake=False)
    sd = d.state_dir
    out = tmp_path / "scaled"
    out.mkdir()
    job = submit(sd, JOB, job_env(out), "--workers", "4")
    wait_state(sd, job, "running", timeout=120)
    wait_until(lambda: job_info(sd, job)["step"] >= 3, 60, what="training to start")
    r = cli("scale", job, "--devices", "4", "--state-dir", str(sd))
    assert r.code == 0 and "already runs on 4 devices; nothing to do" in r.out, r
    for code, args, text in ((1, ["--devices", "0"], "bad_request"), (1, ["--devices", "5"], "must be in 1..4"),
                             (1, ["--devices", "2", "--json"], "bad_request")):
        bad = cli("scale", "j404" if "--json" in args else job, *args, "--state-dir", str(sd))
        assert bad.code == code and (text in bad.err or "unknown_job" in bad.out), bad
    for n, target in enumerate((2, 1, 4), start=1):
        r = cli("scale", job, "--devices", str(target), "--state-dir", str(sd))
        assert r.code == 0 and f"-> {target} devices" in r.out, r
        info = wait_resized(sd, job, n)
        assert info["resizes"][-1]["outcome"] == "done", info["resizes"]
        assert info["resizes"][-1]["stall"] > 0, info["resizes"]   # rank 0's pause, by its own clock
        assert info["devices"] == target and info["state"] == "running"
        # ranks that left exit and give their devices back
        wait_until(lambda t=target: len(status(sd)["nodes"][0]["free"]) == 4 - t, 30, what="devices to be freed")
    (out / "release").touch()
    info = wait_state(sd, job, "finished", timeout=180)
    history = info["resizes"]
    assert [(x["from"], x["to"], x["why"], x["outcome"]) for x in history] == [
        (4, 2, "scale command", "done"), (2, 1, "scale command", "done"), (1, 4, "scale command", "done")]
    assert all(0 < x["seconds"] < 120 and x["handover_s"] is not None for x in history), history
    steps = [x["step"] for x in history]
    assert 0 < steps[0] < steps[1] < steps[2] < STEPS - 1, f"resizes did not land mid-training: {steps}"
    assert_exactly_the_unscaled_run(out, unscaled)
    table = cli("status", "--state-dir", str(sd)).out
    assert "RESIZES" in table and "4->2->1->4" in table
    detail = cli("status", job, "--state-dir", str(sd)).out
    assert "1 -> 4 devices at step" in detail and "done in" in detail
    print("resize seconds (request -> first step at the new size):",
          {f"{x['from']}->{x['to']}": x["seconds"] for x in history})


@pytest.mark.slow
def test_scale_at_resizes_after_exactly_the_steps_asked_refuses_a_grow_it_cannot_place_and_ends_bitwise(
        cluster, tmp_path, unscaled):
    d = cluster.daemon(cpu=3, fake=False)
    sd = d.state_dir
    out = tmp_path / "scheduled"
    out.mkdir()
    (out / "release").touch()   # full speed: the agents hold at each step asked, however late the scheduler is
    # Starts on 2 of the 3 devices with the layout asked, so the grow to 4 after step 80 cannot be placed.
    job = submit(sd, JOB, job_env(out), "--workers", "4", "--layout", "1,3", "--scale-at", "120:2:3/1,40:1,80:4")
    info = wait_state(sd, job, "finished", timeout=300)
    assert [(x["from"], x["to"], x["why"], x["outcome"], x["step"]) for x in info["resizes"]] == [
        (2, 1, "--scale-at 40:1", "done", 40), (1, 4, "--scale-at 80:4", "refused", 80),
        (1, 2, "--scale-at 120:2:3/1", "done", 120)], info["resizes"]
    assert "more needed" in info["resizes"][1]["note"], info["resizes"][1]
    assert info["devices"] == 2 and info["blocks"] == [3, 1]
    assert d.log is not None and f"job {job} starting: 4 workers on 2 devices" in d.log.read_text()
    assert "blocks [1, 3]" in next(x for x in d.log.read_text().splitlines() if f"job {job} starting" in x)
    # The agent that left after step 40 stayed warm for the grow after step 120, which took it.
    assert "joiners [1] starting (1 from agents kept warm" in d.log.read_text()
    assert_exactly_the_unscaled_run(out, unscaled)


@pytest.mark.slow
def test_high_priority_job_shrinks_a_running_job_which_grows_back_when_it_finishes(cluster, tmp_path, unscaled):
    d = cluster.daemon(cpu=4, fake=False)
    sd = d.state_dir
    out, hi_out = tmp_path / "low", tmp_path / "high"
    out.mkdir()
    hi_out.mkdir()
    low = submit(sd, JOB, job_env(out), "--workers", "4", "--min-devices", "1")
    wait_state(sd, low, "running", timeout=120)
    assert job_info(sd, low)["devices"] == 4
    wait_until(lambda: job_info(sd, low)["step"] >= 3, 60, what="training to start")
    # The high-priority job is paced too (20 steps, >= 2 s): unpaced, its millisecond steps on 2 loaded cores
    # can differ 2x between its devices by scheduling noise alone, and the scheduler would learn one of the
    # devices it frees as slow (elasticd/placement/cost.py) and rightly not grow the low one back onto it.
    high = submit(sd, JOB, job_env(hi_out, steps=20, workers=2), "--workers", "2", "--min-devices", "2",
                  "--priority", "5")
    info = wait_resized(sd, low, 1)
    assert [(x["from"], x["to"], x["why"], x["outcome"]) for x in info["resizes"]] == [
        (4, 2, f"policy: preempted by job {high}", "done")]
    assert wait_state(sd, high, "finished", timeout=120)["devices"] == 2
    info = wait_resized(sd, low, 2)
    assert info["resizes"][-1]["to"] == 4 and info["resizes"][-1]["why"] == "policy: grow into freed devices"
    assert info["resizes"][-1]["outcome"] == "done" and info["devices"] == 4
    (out / "release").touch()
    wait_state(sd, low, "finished", timeout=180)
    assert_exactly_the_unscaled_run(out, unscaled)


@pytest.mark.slow
def test_an_agent_dying_mid_hand_over_falls_back_to_the_snapshot_and_ends_as_if_never_scaled(cluster, tmp_path,
                                                                                              unscaled):
    d = cluster.daemon(cpu=4, fake=False)
    sd = d.state_dir
    out = tmp_path / "fell-back"
    out.mkdir()
    hold = out / "hold"
    job = submit(sd, JOB, {**job_env(out), "ELASTICD_TEST_HOLD": str(hold)}, "--workers", "4", "--max-devices", "2")
    wait_state(sd, job, "running", timeout=120)
    wait_until(lambda: job_info(sd, job)["step"] >= 3, 60, what="training to start")
    # Hold the job short of its next step boundary, grow it, and freeze a joiner once every agent has its
    # orders: the old agents then save the snapshot at the boundary and wait for the frozen joiner, which dies.
    hold.touch()
    assert cli("scale", job, "--devices", "4", "--state-dir", str(sd)).code == 0
    wait_until(lambda: (job_info(sd, job)["resizing"] or {}).get("phase") == "go", 120, what="the go")
    joiner = next(a for a in job_info(sd, job)["agents"] if a["rank"] == 3 and a["alive"])
    os.kill(joiner["pid"], signal.SIGSTOP)
    hold.unlink()
    info = wait_until(lambda: (i := job_info(sd, job))["resizing"]["saved"] == 5 and i, 60,
                      what="every part of the snapshot to be saved")
    snaps = StateDir.resolve(sd).job_dir(job)
    assert sorted(os.listdir(snaps / "e1")) == ["groups.pt", "w0.pt", "w1.pt", "w2.pt", "w3.pt"]
    # Other users may at most pass through the agents' area (a root daemon's job users do), never list it.
    assert not stat.S_IMODE(snaps.parent.stat().st_mode) & 0o066, "other users must not list the snapshots"
    assert stat.S_IMODE(snaps.stat().st_mode) == 0o700
    assert "snapshot parts saved 5/5" in cli("status", job, "--state-dir", str(sd)).out
    os.kill(joiner["pid"], signal.SIGKILL)
    info = wait_resized(sd, job, 1)
    (entry,) = info["resizes"]
    assert entry["outcome"] == "rolled back" and "restarted on its 2 devices" in entry["note"], entry
    assert info["devices"] == 2 and info["state"] in ("starting", "running") and info["error"] is None
    assert any("failed half-way" in h[2] for h in info["history"])
    wait_state(sd, job, "running", timeout=120)
    # once a step completed after the restart, nothing can fall back to the snapshot: it is dropped
    wait_until(lambda: not (snaps / "e1").exists(), 120, what="the snapshot to be dropped")
    (out / "release").touch()
    wait_state(sd, job, "finished", timeout=180)
    assert_exactly_the_unscaled_run(out, unscaled)
    wait_until(lambda: not snaps.exists(), 30, what="the finished job's snapshot directory to go")


@pytest.mark.slow
def test_resizes_the_agents_refuse_keep_the_job_on_its_devices_and_lose_nothing(cluster, tmp_path, unscaled):
    d = cluster.daemon(cpu=4, fake=False)
    sd = d.state_dir
    out = tmp_path / "refused"
    out.mkdir()
    # The job's function holds a state no snapshot can carry: its agents refuse every resize and train on.
    job = submit(sd, JOB, {**job_env(out), "ELASTICD_TEST_UNSAVABLE": "1"}, "--workers", "4", "--max-devices", "2")
    wait_state(sd, job, "running", timeout=120)
    wait_until(lambda: job_info(sd, job)["step"] >= 3, 60, what="training to start")
    pids = sorted(a["pid"] for a in job_info(sd, job)["agents"])
    for n, target in enumerate((4, 1), start=1):   # a grow (joiners sent away), a shrink (the leaver stays)
        assert cli("scale", job, "--devices", str(target), "--state-dir", str(sd)).code == 0
        info = wait_resized(sd, job, n)
        entry = info["resizes"][-1]
        assert entry["outcome"] == "refused", info["resizes"]
        assert "cannot carry `warmup` in train() across the resize" in entry["note"], entry
        assert info["devices"] == 2 and info["state"] == "running" and info["error"] is None
        step = info["step"]
        wait_until(lambda s=step: job_info(sd, job)["step"] > s + 2, 60, what="training to go on")
        wait_until(lambda: status(sd)["nodes"][0]["free"] == ["cpu:2", "cpu:3"], 30, what="the joiners' devices")
        assert sorted(a["pid"] for a in job_info(sd, job)["agents"] if a["alive"]) == pids
    detail = cli("status", job, "--state-dir", str(sd)).out
    assert "refused" in detail and "cannot carry `warmup`" in detail, detail
    logs = cli("logs", job, "--state-dir", str(sd)).out   # the job's own output says it, once per resize
    assert logs.count("refused, training goes on: logical rank 0: cannot carry `warmup`") == 2, logs
    (out / "release").touch()
    info = wait_state(sd, job, "finished", timeout=180)
    assert [(x["from"], x["to"], x["outcome"]) for x in info["resizes"]] == [(2, 4, "refused"), (2, 1, "refused")]
    assert_exactly_the_unscaled_run(out, unscaled)


@pytest.mark.slow
def test_a_scheduled_grow_refused_at_its_held_step_before_any_plan_is_recorded_refused(cluster, tmp_path):
    """At full speed the job reaches the held step before the scheduler knows its rate or makes a plan: the
    agents refuse there (a state no snapshot can carry) before the resize exists. The refusal is said again
    under the command's epoch when the command comes, so the grow is recorded refused, not lost."""
    d = cluster.daemon(cpu=2, fake=False)
    sd = d.state_dir
    out = tmp_path / "refused"
    out.mkdir()
    (out / "release").touch()
    job = submit(sd, JOB, {**job_env(out, steps=12), "ELASTICD_TEST_UNSAVABLE": "1"}, "--workers", "4",
                 "--max-devices", "1", "--scale-at", "2:2,6:1")
    info = wait_state(sd, job, "finished", timeout=180)
    assert [(x["step"], x["from"], x["to"], x["outcome"]) for x in info["resizes"]] == [
        (2, 1, 2, "refused"), (6, 1, 1, "refused")], info["resizes"]
    assert "cannot carry `warmup`" in info["resizes"][0]["note"] and "dropped" in info["resizes"][1]["note"]
    assert info["devices"] == 1 and info["error"] is None
    wait_until(lambda: status(sd)["nodes"][0]["free"] == ["cpu:0", "cpu:1"], 30, what="the devices back")


# --- failure paths, with fake agents (same resize protocol, no torch) ---------------------------------

def fake_job(sd: Path, *args: str, **env: str) -> str:
    return submit(sd, FAKE_SCRIPT, env, *args)


def test_a_joiner_that_cannot_start_calls_the_resize_off_and_the_job_finishes(cluster):
    d = cluster.daemon(cpu=2)
    sd = d.state_dir
    job = fake_job(sd, "--workers", "2", "--max-devices", "1", FAKE_JOINER="fail", FAKE_STEPS="400",
                   FAKE_STEP_S="0.01")
    wait_state(sd, job, "running")
    assert cli("scale", job, "--devices", "2", "--state-dir", str(sd)).code == 0
    info = wait_resized(sd, job, 1, timeout=30)
    (entry,) = info["resizes"]
    assert entry["outcome"] == "aborted" and "fake joiner cannot load the script" in entry["note"], entry
    assert info["devices"] == 1 and info["state"] == "running"
    info = wait_state(sd, job, "finished", timeout=30)
    assert info["error"] is None and status(sd)["nodes"][0]["free"] == ["cpu:0", "cpu:1"]


def test_an_agent_dying_while_the_group_re_forms_fails_the_job_with_the_resize_named(cluster):
    d = cluster.daemon(cpu=2)
    sd = d.state_dir
    # Rank 0 dies on the resize command: the group can never re-form (a fake rank 0 that survived would
    # report the resize done without waiting for the others, which a real one cannot).
    job = fake_job(sd, "--workers", "2", "--min-devices", "2", FAKE_MODE="hang", FAKE_RESIZE_CRASH="0")
    wait_state(sd, job, "running")
    assert cli("scale", job, "--devices", "1", "--state-dir", str(sd)).code == 0
    info = wait_state(sd, job, "failed", timeout=30)
    assert info["error"]["message"].startswith("resize 1 (2 -> 1 devices, scale command) failed: agent 0 "
                                               "exited with code 3"), info["error"]
    # fake agents save no snapshot: nothing to fall back to, and the error says so
    assert "no complete snapshot to fall back to" in info["error"]["message"], info["error"]
    assert info["resizes"][-1]["outcome"] == "failed"
    wait_until(lambda: status(sd)["nodes"][0]["free"] == ["cpu:0", "cpu:1"], 30, what="devices to be freed")
    wait_until(lambda: not d.agents(), 30, what="every agent to exit")
    r = cli("status", job, "--state-dir", str(sd))
    assert "resize 1 (2 -> 1 devices" in r.out


def test_a_job_finishing_before_its_joiners_are_warm_finishes_and_sends_them_away(cluster, tmp_path):
    d = cluster.daemon(cpu=2)
    sd = d.state_dir
    never = tmp_path / "never"
    job = fake_job(sd, "--workers", "2", "--max-devices", "1", FAKE_JOINER_WAIT=str(never), FAKE_STEPS="150",
                   FAKE_STEP_S="0.01")
    wait_state(sd, job, "running")
    r = cli("scale", job, "--devices", "2", "--state-dir", str(sd))
    assert r.code == 0, r
    info = wait_state(sd, job, "finished", timeout=30)
    assert info["error"] is None and info["resizes"][-1]["outcome"] == "not applied", info["resizes"]
    wait_until(lambda: status(sd)["nodes"][0]["free"] == ["cpu:0", "cpu:1"], 30, what="devices to be freed")
    wait_until(lambda: not d.agents(), 30, what="the joiner to be sent away")
    assert not os.path.exists(never)
