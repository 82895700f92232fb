"""Draining a node through real daemons: a standalone scheduler and two node daemons on loopback.

A deterministic job (tests/jobs/resize_job.py, 4 logical workers) spans both nodes, one device each. A
drain of the node hosting physical rank 0 (`elasticd drain`), or SIGTERM to the daemon of the other
one (`--drain-grace`), moves it onto the node that stays, live at its next step boundary: the job
finishes bitwise equal to an undisturbed run, and every logical rank ran every step exactly once (the
job's per-rank logs), so no step was redone. A drained node takes no new job until it is undrained.
A job that cannot move off (`--min-devices` forbids the shrink, no device elsewhere) is stopped at the
deadline and waits in the queue to restart from its snapshot, its history naming the drain (fake agents:
nothing of torch is needed for that).
"""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import pytest
from cluster import status, wait_state
from daemon_jobs import FAKE_SCRIPT, JOB, job_env, submit
from util import assert_same_run, cli, wait_until

# Paced at 0.1 s per logical step until released: >= 40 s on 2 devices, so the drain lands mid-run even when
# it has to start its joiners cold on a loaded machine (a grow onto a node that just joined took 7.9 s here
# unloaded; at 80 steps, a 16 s window, CI's job once finished before its drain had moved it).
STEPS = 200


@pytest.fixture(scope="module")
def undisturbed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`elasticd run` of the job on 2 devices, never resized (released from the start: no pacing)."""
    out = tmp_path_factory.mktemp("undisturbed")
    (out / "release").touch()
    r = cli("run", JOB, "--devices", "2", env=job_env(out, steps=STEPS), timeout=600)
    assert r.code == 0, r.err[-3000:]
    return out


def island(cluster, tmp_path: Path, *extra: str, fake: bool = False):
    """A standalone scheduler and nodes a and b (one device each) joined to it over CURVE TCP."""
    sched = cluster.scheduler()
    nodes = [join(cluster, sched, tmp_path, name, *extra, fake=fake) for name in ("a", "b")]
    wait_until(lambda: len(status(sched.state_dir)["nodes"]) == 2, 90, what="both nodes to join")
    return sched, nodes


def join(cluster, sched, tmp_path: Path, name: str, *extra: str, cpu: int = 1, fake: bool = False):
    return cluster.node(sched, name, *extra, cpu=cpu, fake=fake)


def node_of_rank(sd: Path, job: str, rank: int) -> str:
    return next(a["node"] for a in status(sd, job)["jobs"][0]["agents"] if a["rank"] == rank and a["alive"])


def node_row(sd: Path, node: str) -> dict:
    return next(n for n in status(sd)["nodes"] if n["node_id"] == node)


def start_spanning_job(sd: Path, out: Path) -> str:
    out.mkdir()
    job = submit(sd, JOB, job_env(out, steps=STEPS), "--workers", "4", "--min-devices", "1")
    info = wait_state(sd, job, "running", timeout=120)
    assert sorted(info["nodes"]) == ["a", "b"] and info["devices"] == 2, info
    wait_until(lambda: status(sd, job)["jobs"][0]["step"] >= 3, 60, what="training to start")
    return job


@pytest.mark.slow
def test_draining_the_node_of_rank_0_moves_the_job_live_and_it_ends_as_if_undisturbed(cluster, tmp_path,
                                                                                       undisturbed):
    sched, _ = island(cluster, tmp_path)
    sd = sched.state_dir
    out = tmp_path / "job"
    job = start_spanning_job(sd, out)
    lead = node_of_rank(sd, job, 0)
    other = "b" if lead == "a" else "a"

    t0 = time.monotonic()
    r = cli("drain", lead, "--deadline", "120", "--state-dir", str(sd))
    assert r.code == 0 and f"node {lead} draining" in r.out and job in r.out, (r.code, r.out, r.err)
    row = node_row(sd, lead)
    assert row["draining"] is not None and row["draining"]["deadline_s"] <= 120
    # the hand-over can be done before this reads it (1.6 s on CI): either drain state names the node
    assert re.search(rf"^{lead} .* drain(ing|ed) \(", cli("status", "--state-dir", str(sd)).out, re.M)
    # drained: the job runs on the other node alone, and no agent of it is left on the drained one
    wait_until(lambda: node_row(sd, lead)["draining"]["drained"], 120, interval=0.1, what=f"{lead} to drain")
    drain_s = time.monotonic() - t0
    info = status(sd, job)["jobs"][0]
    assert info["state"] == "running" and info["nodes"] == [other] and info["devices"] == 1, info
    (move,) = info["resizes"]
    assert (move["from"], move["to"], move["why"], move["outcome"]) == (2, 1, f"drain of node {lead}", "done")
    assert "drained" in cli("status", "--state-dir", str(sd)).out

    # the drained node takes no new job: one that fits only there waits, and starts once it is undrained
    small = tmp_path / "small"
    small.mkdir()
    (small / "release").touch()
    nxt = submit(sd, JOB, job_env(small, steps=3, workers=1), "--workers", "1")
    assert wait_state(sd, nxt, "queued")["nodes"] == []
    assert node_row(sd, lead)["free"] and status(sd, nxt)["jobs"][0]["state"] == "queued"
    bad = cli("undrain", other, "--state-dir", str(sd))
    assert bad.code == 1 and "not draining" in bad.err, bad
    r = cli("undrain", lead, "--json", "--state-dir", str(sd))
    assert r.code == 0 and "back in service" in r.json()["message"], r
    assert wait_state(sd, nxt, "finished", timeout=120)["nodes"] == [lead]

    (out / "release").touch()
    wait_state(sd, job, "finished", timeout=180)
    assert_same_run(out, undisturbed, STEPS, ranks=4)   # bitwise, and every step run once by every rank
    print(f"drain of the node of rank 0: {drain_s:.2f}s from the command to the node empty; "
          f"hand-over at step {move['step']} took {move['seconds']:.2f}s; steps redone: 0")


@pytest.mark.slow
def test_sigterm_to_a_daemon_with_a_grace_period_drains_its_node_then_exits(cluster, tmp_path, undisturbed):
    sched, nodes = island(cluster, tmp_path, "--drain-grace", "120")
    sd = sched.state_dir
    out = tmp_path / "job"
    job = start_spanning_job(sd, out)
    lead = node_of_rank(sd, job, 0)
    leaving = next(d for d in nodes if d.info()["node_id"] != lead)

    t0 = time.monotonic()
    leaving.popen.send_signal(signal.SIGTERM)
    leaving.popen.wait(timeout=120)   # it exits once its agents are gone, well within the grace period
    exit_s = time.monotonic() - t0
    assert leaving.popen.returncode == 0, leaving.output()[-3000:]
    info = status(sd, job)["jobs"][0]
    assert info["state"] == "running" and info["nodes"] == [lead], info
    assert [(x["from"], x["to"], x["outcome"]) for x in info["resizes"]] == [(2, 1, "done")]
    (out / "release").touch()
    wait_state(sd, job, "finished", timeout=180)
    assert_same_run(out, undisturbed, STEPS, ranks=4)
    print(f"SIGTERM drain of the node of rank 1: daemon gone {exit_s:.2f}s after the signal; steps redone: 0")


def test_a_job_that_cannot_move_off_is_requeued_from_its_snapshot_at_the_deadline(cluster, tmp_path):
    sched, _ = island(cluster, tmp_path, fake=True)
    sd = sched.state_dir
    r = cli("submit", FAKE_SCRIPT, "--workers", "2", "--min-devices", "2", "--env", "FAKE_MODE=hang",
            "--state-dir", str(sd))
    assert r.code == 0, r.err
    job = r.out.strip()
    wait_state(sd, job, "running")
    for bad, code, text in ((["nowhere"], 1, "unknown_node"), (["a", "--deadline", "-1"], 2, "")):
        x = cli("drain", *bad, "--state-dir", str(sd))
        assert x.code == code and text in x.err, x
    r = cli("drain", "a", "--deadline", "3", "--json", "--state-dir", str(sd))
    assert r.code == 0 and "draining" in r.json()["message"], r
    waiting = wait_until(lambda: node_row(sd, "a")["draining"]["waiting"], 10, what="the drain to say why it waits")
    assert job in waiting and "--min-devices 2" in waiting, waiting
    info = wait_state(sd, job, "queued", timeout=30)
    assert any(h[1] == "recovering" and "node a was drained and its deadline passed" in h[2]
               for h in info["history"]), info["history"]
    wait_until(lambda: node_row(sd, "a")["draining"]["drained"], 30, what="a to drain once the job's agents are gone")


@pytest.mark.slow
def test_a_job_wholly_on_the_drained_node_grows_onto_the_other_then_leaves_it(cluster, tmp_path, undisturbed):
    sched = cluster.scheduler()
    sd = sched.state_dir
    join(cluster, sched, tmp_path, "a", cpu=2)
    out = tmp_path / "job"
    out.mkdir()
    job = submit(sd, JOB, job_env(out, steps=STEPS), "--workers", "4", "--min-devices", "2", "--max-devices", "2")
    assert wait_state(sd, job, "running", timeout=120)["nodes"] == ["a"]
    join(cluster, sched, tmp_path, "b", cpu=2)
    wait_until(lambda: len(status(sd)["nodes"]) == 2, 90, what="node b to join")
    wait_until(lambda: status(sd, job)["jobs"][0]["step"] >= 3, 60, what="training to start")
    t0 = time.monotonic()
    assert cli("drain", "a", "--deadline", "120", "--state-dir", str(sd)).code == 0
    wait_until(lambda: node_row(sd, "a")["draining"]["drained"], 120, interval=0.1, what="a to drain")
    drain_s = time.monotonic() - t0
    info = status(sd, job)["jobs"][0]
    assert info["nodes"] == ["b"] and info["devices"] == 2, (info["state"], info["step"], info["resizes"],
                                                             info["history"])
    assert [(x["from"], x["to"], x["outcome"]) for x in info["resizes"]] == [(2, 4, "done"), (4, 2, "done")]
    (out / "release").touch()
    wait_state(sd, job, "finished", timeout=180)
    assert_same_run(out, undisturbed, STEPS, ranks=4)
    print(f"drain of the node holding the whole job: {drain_s:.2f}s (grow onto b, then shrink off a); "
          "steps redone: 0")
