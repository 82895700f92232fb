"""A job spanning two islands, end to end on loopback: a federation front, two island schedulers over CURVE
TCP, a node daemon with two CPU devices on each, real agents. The front splits the job, each island holds
its portion, the agents of both form one group and sum in two levels (agent/comm/islands.py)."""

from __future__ import annotations

import json
import signal

import pytest
from cluster import Cluster, status
from daemon_jobs import JOB, job_env, submit
from util import (
    JOBS,
    assert_same_run,
    cli,
    completed_twice,
    load_state,
    rel_diffs,
    shared_servers,
    wait_until,
)

from elasticd import protocol as p
from elasticd.control_client import Client, ErrorReply, Target
from elasticd.reference_launch import run_native_ddp

WORKERS, STEPS = 8, 12
TOLERANCE = 1e-5   # as tests/system/test_equivalence.py: the two-level sums reorder fp32 additions, nothing more


@pytest.fixture
def islands(tmp_path):
    c = Cluster(tmp_path)
    front = c.federation(island_timeout=2.0)
    a, b = c.island(front, "A"), c.island(front, "B")
    c.node(a, "a1", cpu=2, fake=False)
    c.node(b, "b1", cpu=2, fake=False)
    wait_until(lambda: {i: t["capacity"]["free"] for i, t in table(front).items()} == {"A": 2, "B": 2}, 60,
               what="both islands up with their node's 2 devices free")
    yield c, front, a, b
    c.cleanup()


def table(front) -> dict[str, dict]:
    r = cli("islands", "--json", "--state-dir", str(front.state_dir))
    assert r.code == 0, r
    return {i["island_id"]: i for i in r.json()["islands"]}


def spans(front, job: str = "") -> list[dict]:
    r = cli("islands", "--jobs", *([job] if job else []), "--json", "--state-dir", str(front.state_dir))
    assert r.code == 0, r
    return r.json()["jobs"]


def one_island_run(tmp_path, steps: int):
    """The job on one island's worth of devices (`elasticd run`, 2 devices), unpaced: the reference."""
    ref = tmp_path / "ref"
    ref.mkdir()
    (ref / "release").touch()
    r = cli("run", JOB, "--workers", str(WORKERS), "--devices", "2", env=job_env(ref, steps, WORKERS), timeout=300)
    assert r.code == 0, r.err[-3000:]
    return ref


def submit_spanning(front, script, env: dict[str, str], *args: str, timeout: float = 300.0):
    envs = [x for k, v in env.items() for x in ("--env", f"{k}={v}")]
    return cli("submit", str(script), "--workers", str(WORKERS), "--islands", "A,B", "--state-dir",
               str(front.state_dir), *envs, *args, timeout=timeout)


@pytest.mark.slow
def test_a_job_split_over_two_islands_is_bitwise_the_one_island_run(islands, tmp_path):
    _c, front, a, b = islands
    ref = one_island_run(tmp_path, STEPS)
    out = tmp_path / "spanning"
    out.mkdir()
    (out / "release").touch()
    r = submit_spanning(front, JOB, job_env(out, STEPS, WORKERS), "--wait")
    assert r.code == 0, (r.out, r.err[-3000:], front.output()[-3000:])
    assert_same_run(out, ref, STEPS, ranks=WORKERS)
    (span,) = spans(front)
    assert span["state"] == "finished" and span["devices"] == 4
    assert [(pt["island"], pt["ranks"], pt["workers"], pt["state"]) for pt in span["portions"]] == [
        ("A", "0-1", 4, "finished"), ("B", "2-3", 4, "finished")]
    for island, ranks in ((a, "ranks 0-1 of 4"), (b, "ranks 2-3 of 4")):
        (job,) = status(island.state_dir)["jobs"]
        assert job["state"] == "finished" and job["portion_of"].startswith(span["span_id"]) and ranks in job["portion_of"]
    text = cli("islands", "--jobs", "--state-dir", str(front.state_dir)).out
    assert "portion 1 on B: ranks 2-3, 4 workers" in text and "finished" in text


@pytest.mark.slow
def test_with_island_b_full_the_job_waits_holding_nothing_then_runs_as_ddp_does(islands, tmp_path):
    _c, front, a, b = islands
    busy = tmp_path / "busy"
    busy.mkdir()
    local = submit(b.state_dir, JOB, job_env(busy, 300, 2), "--workers", "2", "--min-devices", "2")
    wait_until(lambda: table(front)["B"]["capacity"]["free"] == 0, 30, what="B's own job to hold its devices")
    out = tmp_path / "final.pt"
    env = {"ELASTICD_TEST_WORKERS": str(WORKERS), "ELASTICD_TEST_OUT": str(out), "ELASTICD_BUCKET_KB": "1"}
    r = submit_spanning(front, JOBS / "mlp_sgd.py", env)
    assert r.code == 0, r
    job = r.out.strip()
    wait_until(lambda: "island B has no free device" in spans(front, job)[0]["reason"], 30, what="the job to wait")
    assert spans(front, job)[0]["state"] == "waiting"
    assert table(front)["A"]["capacity"]["free"] == 2, "A holds devices for a job that cannot start"
    assert cli("stop", local, "--state-dir", str(b.state_dir)).code == 0
    done = wait_until(lambda: (s := spans(front, job)[0])["state"] in ("finished", "failed", "stopped") and s, 300,
                      what="the job to end once B frees its devices")
    assert done["state"] == "finished", (done, front.output()[-3000:])
    ref = tmp_path / "ddp"
    ref.mkdir()
    code = run_native_ddp(str(JOBS / "mlp_sgd.py"), None, WORKERS, timeout=300,
                          env={**shared_servers(), "ELASTICD_TEST_WORKERS": str(WORKERS),
                               "ELASTICD_TEST_OUT": str(ref / "final.pt")})
    assert code == 0
    diffs = rel_diffs(load_state(ref / "final.pt"), load_state(out))
    assert max(diffs.values()) <= TOLERANCE, diffs
    assert [h[1] for h in done["history"]] == ["waiting", "reserving", "starting", "running", "finished"]


@pytest.mark.slow
def test_losing_an_island_mid_run_restarts_the_job_on_the_other_from_its_snapshot_and_b_back_joins_live(tmp_path):
    """Island B (its scheduler, its node, its agents) is killed mid-run: the job restarts on A alone from its
    newest periodic snapshot, whose parts of B's workers A holds as copies. B comes back: the job grows onto
    it live, A's agents going on where they are. It ends bitwise as if nothing had happened, every step taken
    once per logical rank as far as the run kept."""
    c = Cluster(tmp_path)
    try:
        front = c.federation(island_timeout=2.0)
        a, b = c.island(front, "A"), c.island(front, "B")
        c.node(a, "a1", cpu=2, fake=False)
        node_b = c.node(b, "b1", cpu=2, fake=False, own_forks=True)   # its agents are its own children
        wait_until(lambda: {i: t["capacity"]["free"] for i, t in table(front).items()} == {"A": 2, "B": 2}, 60,
                   what="both islands up")
        steps = 150
        ref = one_island_run(tmp_path, steps)
        out = tmp_path / "out"
        out.mkdir()
        r = submit_spanning(front, JOB, job_env(out, steps, WORKERS), "--snapshot-every", "3")
        assert r.code == 0, r
        job = r.out.strip()
        # A's portion shows on A once the front's reservation reached it, a moment after the submit returned.
        wait_until(lambda: any((j.get("snapshot") or {}).get("step", 0) >= 6 for j in status(a.state_dir)["jobs"]),
                   120, what="a periodic snapshot or two, taken across both islands")
        agents = node_b.agents()
        b.kill(signal.SIGKILL)
        node_b.kill(signal.SIGKILL)
        for agent in agents:
            agent.kill()
        back = wait_until(lambda: (s := spans(front, job)[0])["state"] == "running" and s["restarts"] == 1 and s, 120,
                          what="the job to run again, on A alone")
        assert [(pt["island"], pt["ranks"], pt["workers"]) for pt in back["portions"]] == [("A", "0-1", 8)]
        assert any("island B" in h[2] for h in back["history"]), back["history"]
        b.argv[b.argv.index("--bind") + 1] = b.info()["tcp"]   # where its node looks for it
        b.start()
        node_b.start()
        again = wait_until(lambda: (s := spans(front, job)[0])["state"] == "running" and len(s["portions"]) == 2
                           and s, 120, what="the job to run across A and B again")
        assert [(pt["island"], pt["ranks"], pt["workers"]) for pt in again["portions"]] == [("A", "0-1", 4),
                                                                                           ("B", "2-3", 4)]
        assert again["restarts"] == 1 and again["attempt"] == back["attempt"], again
        assert any("grew live onto island B" in h[2] for h in again["history"]), again["history"]
        # live: A's portion is the same island job, its agents the same processes, no step done again
        assert again["portions"][0]["job_id"] == back["portions"][0]["job_id"]
        redone_before = completed_twice(out)
        (portion_a,) = [j for j in status(a.state_dir)["jobs"] if j["job_id"] == back["portions"][0]["job_id"]]
        move = portion_a["resizes"][-1]
        assert move["outcome"] == "done" and "spanning islands: 2 -> 4 agents in all" in move["why"], move
        assert move["handover_s"] is not None and move["step"] is not None, move
        (out / "release").touch()
        done = wait_until(lambda: (s := spans(front, job)[0])["state"] in ("finished", "failed") and s, 180,
                          what="the job to end")
        assert done["state"] == "finished", done
        assert_same_run(out, ref, steps, ranks=WORKERS, recovered=True)
        redone = completed_twice(out)
        assert 0 not in redone, f"restarted from the beginning, not from a snapshot: redid {redone}"
        assert redone == redone_before, f"steps done again after B joined: {sorted(set(redone) - set(redone_before))}"
    finally:
        c.cleanup()


@pytest.mark.slow
def test_draining_an_island_s_node_moves_the_job_off_it_live_onto_the_other_island(islands, tmp_path):
    """A drain of A's only node: the front shrinks the job off A's ranks live, B's agents going on as ranks
    0-1 of 2 and taking A's workers. Nothing is redone, the node drains, and the run is bitwise the
    one-island run."""
    _c, front, a, b = islands
    steps = 40
    ref = one_island_run(tmp_path, steps)
    out = tmp_path / "out"
    out.mkdir()
    r = submit_spanning(front, JOB, job_env(out, steps, WORKERS))
    assert r.code == 0, r
    job = r.out.strip()
    wait_until(lambda: spans(front, job)[0]["step"] >= 3, 120, what="a few steps across both islands")
    assert cli("drain", "a1", "--state-dir", str(a.state_dir)).code == 0
    moved = wait_until(lambda: (s := spans(front, job)[0])["state"] == "running" and len(s["portions"]) == 1 and s,
                       120, what="the job to move off A's node")
    assert [(pt["island"], pt["ranks"], pt["workers"]) for pt in moved["portions"]] == [("B", "0-1", 8)]
    assert any("moved live off 2 device(s) its islands wanted back, leaving island A" in h[2] for h in moved["history"]), moved
    assert moved["restarts"] == 0 and moved["attempt"] == 1
    wait_until(lambda: (status(a.state_dir)["nodes"][0].get("draining") or {}).get("drained"), 60,
               what="A's node drained once the job's agents left it")
    (out / "release").touch()
    done = wait_until(lambda: (s := spans(front, job)[0])["state"] in ("finished", "failed") and s, 180,
                      what="the job to end")
    assert done["state"] == "finished", done
    assert_same_run(out, ref, steps, ranks=WORKERS)
    assert completed_twice(out) == []


def test_only_the_key_that_submitted_a_job_stops_it_and_only_the_front_commands_a_portion(tmp_path):
    """No agents: a front and island A with no node (the job waits). Client keys of the front submit and
    stop their own jobs only; an island key submits nothing; the island's scheduler takes a portion's
    commands from nobody but its front."""
    c = Cluster(tmp_path)
    try:
        front = c.federation()
        a = c.island(front, "A")
        wait_until(lambda: "A" in table(front), 30, what="island A up")
        remote = ["--endpoint", front.info()["tcp"], "--server-key", front.info()["public_key"]]
        pubs = {}
        for name in ("alice", "bob"):
            pubs[name] = cli("keygen", "--state-dir", str(tmp_path / name)).out.strip()
            assert cli("keygen", "--state-dir", str(front.state_dir), "--allow", pubs[name], "--role", "client").code == 0
        r = cli("submit", str(JOB), "--workers", "4", "--islands", "A", "--state-dir", str(tmp_path / "alice"), *remote)
        assert r.code == 0, r
        job = r.out.strip()
        wait_until(lambda: "island A has no free device" in spans(front, job)[0]["reason"], 30, what="the job to wait")
        assert spans(front, job)[0]["owner"] == pubs["alice"]
        r = cli("stop", job, "--state-dir", str(tmp_path / "bob"), *remote)
        assert r.code == 1 and "may not stop job" in r.err, r
        r = cli("submit", str(JOB), "--workers", "4", "--islands", "A", "--state-dir", str(a.state_dir), *remote)
        assert r.code == 1 and "may not send submit_spanning" in r.err, r   # A's own key, an island's
        r = cli("stop", "s404", "--state-dir", str(front.state_dir))
        assert r.code == 1 and "no job 's404' at this front" in r.err, r
        assert cli("stop", job, "--state-dir", str(tmp_path / "alice"), *remote).code == 0
        assert spans(front, job)[0]["state"] == "stopped"
        seen = cli("events", "--json", "--state-dir", str(tmp_path / "alice"), *remote)
        assert seen.code == 0, seen
        evs = [json.loads(line) for line in seen.out.splitlines()]
        assert [e["event"] for e in evs if e.get("job") == job] == ["submitted", "stopped"]
        assert {"event": "island_joined", "island": "A"}.items() <= next(e for e in evs if "island" in e).items()
        assert cli("events", job, "--state-dir", str(tmp_path / "bob"), *remote).out == ""   # not bob's
        bad = cli("submit", str(JOB), "--workers", "4", "--islands", "A", "--layout", "2,2",
                  "--state-dir", str(front.state_dir))
        assert bad.code == 2 and "--layout: not for a job spanning islands" in bad.err, bad
        spec = p.PortionSpec(span_id="s1", attempt=1, index=0, workers=4, world=1, rank_offset=0, blocks=[4],
                             islands=[1])
        with Client(Target(f"ipc://{a.state_dir / 'scheduler.sock'}")) as cl:
            for msg in (p.ReservePortion(portion=spec, script=str(JOB)), p.StartPortion(span_id="s1", attempt=1),
                        p.MovePortion(span_id="s1", attempt=1, epoch=1, devices_from=1, world=2, blocks=[2, 2],
                                      islands=[2]),
                        p.GoPortion(span_id="s1", attempt=1, epoch=1, master_addr="127.0.0.1", master_port=1),
                        p.AbortPortionMove(span_id="s1", attempt=1, epoch=1)):
                with pytest.raises(ErrorReply, match="taken only from the federation front"):
                    cl.request(msg)
        assert status(a.state_dir)["jobs"] == []
    finally:
        c.cleanup()
