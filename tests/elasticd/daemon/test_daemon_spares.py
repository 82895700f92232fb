"""The node daemon's warm spare agents (elasticd/daemon/spares.py, agent/spare.py), with real processes.

A spare must run an agent as `python -m agent` would (same sys.path, cwd, environment and argv; output
in the job's log), be used for launches and for grows, fail a broken script as a cold start does, be
replaced when used or dead (without a restart loop), and stay unused where it cannot serve: --spares 0,
a fake agent command, a job env that sets interpreter start-up variables.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from cluster import Proc, status, wait_state
from daemon_jobs import JOB, job_env, submit, wait_resized
from util import REPO, assert_same_run, cli, wait_until

from elasticd.agent.proc_name import STANDBY
from elasticd.core.commands import module_command
from elasticd.daemon.spares import SparePool
from elasticd.ports import free_port
from elasticd.startup_env import startup_differences

FAKE_SCRIPT = str(REPO / "tests" / "jobs" / "fake_agent.py")
STEPS, WORKERS = 300, 2

# Records, at import, what the process looks like to a user's script; trains nothing.
PROBE = """\
import json, os, sys
import elasticd
with open(os.environ["PROBE_OUT"], "w") as f:
    json.dump({"path": sys.path, "cwd": os.getcwd(), "argv": sys.argv, "env": dict(os.environ),
               "stdin": os.readlink("/proc/self/fd/0")}, f)
print("probe imported", flush=True)

@elasticd.elastic(workers=1)
def train(ctx):
    print("probe trained; malloc tuned:", sys.modules["elasticd.agent.slicer.malloc"]._done, flush=True)
"""


@pytest.fixture(scope="module")
def cold_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`elasticd run` of the resize job on 1 device (agents started cold), released from the start."""
    out = tmp_path_factory.mktemp("cold")
    (out / "release").touch()
    r = cli("run", JOB, "--devices", "1", env=job_env(out, STEPS, WORKERS), timeout=600)
    assert r.code == 0, r.err[-3000:]
    return out


def idle_spares(d: Proc, sd: Path) -> set[int]:
    """Pids of the daemon's spare processes that no job's agent is (yet)."""
    agents = {a["pid"] for j in status(sd)["jobs"] for a in j["agents"]}
    return {k.pid for k in d.agents() if _is_spare(k)} - agents


def _is_spare(proc: psutil.Process) -> bool:
    """A spare names itself so (agent/spare.py), cold or forked; so does a standby agent, which has a job."""
    try:
        return proc.status() != psutil.STATUS_ZOMBIE and proc.name() == STANDBY
    except psutil.Error:
        return False


def run_released(d: Proc, tmp_path: Path) -> tuple[str, dict, Path]:
    """Submit the job released from the start (no pacing) to `d` and wait until it has finished: its id,
    its status row and its output directory."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "release").touch()
    job = submit(d.state_dir, JOB, job_env(out, STEPS, WORKERS), "--workers", str(WORKERS))
    info = wait_state(d.state_dir, job, ("finished", "failed"), timeout=180)
    assert info["state"] == "finished", (info["error"], d.output()[-3000:])
    return job, info, out


def assert_same_as_cold(out: Path, cold: Path) -> None:
    assert_same_run(out, cold, STEPS, ranks=WORKERS)


def test_a_spare_runs_an_agent_as_python_m_agent_would(tmp_path):
    """A cold spare and a forked one (from a pool's fork server), each given the job as the daemon gives it,
    against the agent the daemon would start cold: same sys.path, cwd, argv, environment and stdin."""
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    job_cwd, spare_cwd = tmp_path / "job", tmp_path / "spare"
    job_cwd.mkdir()
    spare_cwd.mkdir()
    # a relative PYTHONPATH entry resolves against the cwd the interpreter starts in: the job's, not the spare's
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(REPO), "rel"])}
    spare = subprocess.Popen(module_command("elasticd.agent.spare"), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, cwd=spare_cwd, env=env, start_new_session=True)
    pool = SparePool(1, env, spare_cwd, tmp_path / "spares.log", fork=True)
    runs = {}
    try:
        log_text = (tmp_path / "spares.log").read_text
        wait_until(lambda: pool.replenish() or "forked ready in" in log_text(), 120, interval=0.05,
                   what="a forked spare")
        for how in ("spare", "forked", "cold"):
            argv = ["--script", str(script), "--workers", "1", "--rank", "0", "--world", "1",
                    "--master-port", str(free_port("127.0.0.1")), "--job-id", how]
            job_env = {**env, "PROBE_OUT": str(tmp_path / f"{how}.json")}
            log = tmp_path / f"{how}.log"
            if how == "spare":
                spare.stdin.write(json.dumps({"argv": argv, "env": job_env, "cwd": str(job_cwd),
                                              "log": str(log)}).encode() + b"\n")
                spare.stdin.close()
                proc = spare
            elif how == "forked":
                proc = pool.take(argv, job_env, str(job_cwd), log, "probe")
                assert proc is not None
            else:
                with open(log, "ab") as out:
                    proc = subprocess.Popen([*module_command(), *argv], stdin=subprocess.DEVNULL,
                                            stdout=out, stderr=subprocess.STDOUT, cwd=job_cwd, env=job_env)
            runs[how] = (proc, argv, log)
        for proc, _argv, log in runs.values():
            assert proc.wait(timeout=120) == 0, log.read_text()
    finally:
        for proc, _argv, _log in runs.values():
            if proc.poll() is None:
                proc.kill()
        if spare.poll() is None:
            spare.kill()
        pool.shutdown(5.0)
        pool.close()
    seen = {how: json.loads((tmp_path / f"{how}.json").read_text()) for how in runs}
    for how in ("spare", "forked"):
        assert seen[how]["path"] == seen["cold"]["path"], how
        assert seen[how]["cwd"] == seen["cold"]["cwd"] == str(job_cwd), how
        assert seen[how]["stdin"] == seen["cold"]["stdin"] == os.devnull, how
    assert str(job_cwd / "rel") in seen["cold"]["path"]
    for how, (_proc, argv, log) in runs.items():
        assert seen[how]["argv"] == [str(script)], argv   # as `python probe.py` (no ARGS) has it
        assert log.read_text().splitlines()[-2:] == ["probe imported", "probe trained; malloc tuned: True"]
    for how in runs:
        del seen[how]["env"]["PROBE_OUT"]
        # torch sets this one in its own process when torch._dynamo is first imported (agent/process.py
        # imports it): a cold agent has it before the script loads, a spare imported it before it took on
        # the job's environment and computes the same value again when inductor asks. Not the launcher's doing.
        if "TORCHINDUCTOR_CACHE_DIR" not in env:
            seen[how]["env"].pop("TORCHINDUCTOR_CACHE_DIR", None)
    assert seen["spare"]["env"] == seen["forked"]["env"] == seen["cold"]["env"]


def test_only_interpreter_start_up_variables_keep_a_job_off_the_spares():
    spare = {"PATH": "/bin", "PYTHONPATH": "/repo", "OMP_NUM_THREADS": "2"}
    assert startup_differences({**spare, "ELASTICD_JOB_ID": "j1", "MY_SETTING": "x"}, spare) == []
    assert startup_differences({**spare, "OMP_NUM_THREADS": "1", "LD_PRELOAD": "/x.so", "CUDA_VISIBLE_DEVICES": "1",
                                "PYTHONHASHSEED": "0"}, spare) == [
        "CUDA_VISIBLE_DEVICES", "LD_PRELOAD", "OMP_NUM_THREADS", "PYTHONHASHSEED"]
    assert startup_differences({"PATH": "/bin", "PYTHONPATH": "/repo"}, spare) == ["OMP_NUM_THREADS"]


@pytest.mark.parametrize("fork", [False, True], ids=["cold", "fork-server-dies-too"])
def test_spares_that_keep_dying_are_restarted_with_a_growing_delay(tmp_path, caplog, fork):
    # An interpreter that cannot find its standard library dies at once, like a spare on a broken install.
    # So does the fork server: the pool starts spares cold then, which die in turn.
    pool = SparePool(1, {**os.environ, "PYTHONHOME": str(tmp_path / "nowhere")}, tmp_path, tmp_path / "spares.log",
                     fork=fork)
    started: set[int] = set()
    end = time.monotonic() + 4.0
    try:
        def four_seconds_of_replenishing() -> bool:
            pool.replenish()
            started.update(pool.pids())
            return time.monotonic() > end
        wait_until(four_seconds_of_replenishing, 10, interval=0.01)
    finally:
        pool.shutdown(2.0)
        pool.close()
    # restarts after 1 s, then 2 s, then 4 s; a restart loop would have started hundreds
    assert 2 <= len(started) <= 4, started
    assert "before it was used" in caplog.text and "next spare in 2s" in caplog.text
    assert ("elasticd fork server: it exited; agents start cold from now on" in caplog.text) == fork


@pytest.mark.slow
def test_a_fresh_daemon_offers_its_devices_once_its_fork_server_is_up_so_the_first_job_forks_its_agents(
        cluster, tmp_path):
    """A job submitted as soon as a fresh daemon's node has joined runs every agent on a forked spare: the
    node said hello only after its spares' fork server had imported torch and forked them (no agent started
    cold beside that import)."""
    d = cluster.daemon(cpu=2, fake=False, own_forks=True)
    job, _, _ = run_released(d, tmp_path)
    log = d.output()
    assert "offering its devices once the spares' fork server has imported torch" in log
    assert "cold start" not in log, log[-3000:]
    assert log.count(f"job {job} agent ") == log.count("started on spare agent pid") == 2, log[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("forked", [True, False], ids=["forked", "cold"])
def test_a_launch_runs_on_a_pre_started_spare_and_computes_what_a_cold_run_does(cluster, tmp_path, cold_run, forked):
    d = cluster.daemon(cpu=1, fake=False, own_forks=True, env={} if forked else {"ELASTICD_FORKSERVER": "0"})
    sd = d.state_dir
    spares = wait_until(lambda: idle_spares(d, sd), 60, what="a spare agent")
    # forked from the daemon's fork server, which imported torch once; or started cold, each importing it
    (spare,) = spares
    parent = psutil.Process(spare).parent()
    assert parent is not None
    assert ("elasticd.agent.forkserver" in parent.cmdline()) == forked, parent.cmdline()
    assert ("forked ready in" in (sd / "spares.log").read_text()) == forked
    job, info, out = run_released(d, tmp_path)
    (agent,) = info["agents"]
    assert agent["pid"] in spares
    assert f"job {job} agent 0: started on spare agent pid {agent['pid']}" in d.output()
    assert_same_as_cold(out, cold_run)
    log = (sd / "logs" / job / "rank0.log").read_text()
    assert log.startswith(f"=== elasticd: job {job} agent 0/1 on cpu:0 started ") and log.count("=== elasticd") == 1
    # the one used is replaced
    wait_until(lambda: idle_spares(d, sd) - spares, 60, what="a new spare")


@pytest.mark.slow
def test_a_grow_takes_its_joiner_from_the_spares(cluster, tmp_path, cold_run):
    d = cluster.daemon(cpu=2, fake=False, own_forks=True)
    sd = d.state_dir
    out = tmp_path / "out"
    out.mkdir()
    job = submit(sd, JOB, job_env(out, STEPS, WORKERS), "--workers", str(WORKERS), "--max-devices", "1")
    wait_state(sd, job, "running", timeout=120)
    wait_until(lambda: status(sd, job)["jobs"][0]["step"] >= 3, 60, what="training to start")
    spares = wait_until(lambda: idle_spares(d, sd), 60, what="the spare that replaced the launch's")
    r = cli("scale", job, "--devices", "2", "--state-dir", str(sd))
    assert r.code == 0 and "-> 2 devices" in r.out, r
    info = wait_resized(sd, job, 1)
    (entry,) = info["resizes"]
    assert entry["outcome"] == "done" and (entry["from"], entry["to"]) == (1, 2), entry
    assert entry["prepare_s"] is not None   # joiner warm-up, measured; scripts/bench_daemon_grow.py times it
    joiner = next(a for a in info["agents"] if a["rank"] == 1)
    assert joiner["pid"] in spares
    print("grow 1 -> 2 on a spare:", {k: entry[k] for k in ("seconds", "prepare_s", "handover_s")})
    (out / "release").touch()
    info = wait_state(sd, job, ("finished", "failed"), timeout=180)
    assert info["state"] == "finished", info["error"]
    assert_same_as_cold(out, cold_run)


@pytest.mark.slow
def test_the_pool_keeps_a_spare_per_idle_device_and_one_while_all_are_busy(cluster, tmp_path):
    d = cluster.daemon(cpu=2, fake=False, own_forks=True)
    sd = d.state_dir
    first = wait_until(lambda: s if len(s := idle_spares(d, sd)) == 2 else None, 120, what="a spare per device")
    out = tmp_path / "out"
    out.mkdir()
    job = submit(sd, JOB, job_env(out, STEPS, WORKERS), "--workers", str(WORKERS), "--max-devices", "1")
    wait_state(sd, job, "running", timeout=120)
    assert cli("scale", job, "--devices", "2", "--state-dir", str(sd)).code == 0
    info = wait_resized(sd, job, 1)
    assert info["resizes"][-1]["outcome"] == "done", info["resizes"]
    assert {a["pid"] for a in info["agents"] if a["alive"]} == first   # launch and grow both took a spare
    wait_until(lambda: len(idle_spares(d, sd)) == 1, 60, what="one spare while every device is busy")
    assert cli("stop", job, "--state-dir", str(sd)).code == 0
    wait_state(sd, job, "stopped", timeout=60)
    wait_until(lambda: len(idle_spares(d, sd)) == 2, 120, what="spares back on the freed devices")


@pytest.mark.slow
def test_a_script_broken_at_import_fails_on_a_spare_as_it_does_cold(cluster, tmp_path):
    d = cluster.daemon(cpu=1, fake=False, own_forks=True)
    sd = d.state_dir
    script = tmp_path / "broken.py"
    # An @elastic script (a torchrun-mode one would fail in its workers, not at load)
    script.write_text("import elasticd\n\nraise RuntimeError('broken at import')\n\n"
                      "@elasticd.elastic(workers=1)\ndef train(ctx):\n    pass\n")
    spares = wait_until(lambda: idle_spares(d, sd), 60, what="a spare agent")
    errors = {}
    for how, env in (("spare", []), ("cold", ["--env", "PYTHONHASHSEED=0"])):
        r = cli("submit", str(script), "--workers", "1", "--wait", *env, "--state-dir", str(sd), timeout=180)
        assert r.code == 1 and "RuntimeError: broken at import" in r.err, (r, d.output()[-3000:])
        info = wait_state(sd, r.out.split()[0], "failed")
        errors[how] = (info["error"], info["agents"][0]["pid"])
    assert errors["spare"][1] in spares and errors["cold"][1] not in spares
    assert "cold start, not a spare: the job sets PYTHONHASHSEED" in d.output()
    spare_err, cold_err = errors["spare"][0], errors["cold"][0]
    assert spare_err["message"] == cold_err["message"] == f"cannot load {script}: RuntimeError: broken at import"
    assert spare_err["traceback"] == cold_err["traceback"]
    # the daemon serves on, with its pool refilled; a spare killed while idle is replaced too
    (fresh,) = wait_until(lambda: idle_spares(d, sd) - spares, 60, what="a new spare")
    os.kill(fresh, signal.SIGKILL)
    wait_until(lambda: idle_spares(d, sd) - spares - {fresh}, 60, what="the killed spare to be replaced")
    assert f"spare agent pid {fresh} exited with code -9" in d.output()
    # shutting the daemon down takes its spares along
    idle = idle_spares(d, sd)
    assert cli("shutdown", "--state-dir", str(sd)).code == 0
    d.popen.wait(timeout=30)
    wait_until(lambda: not any(psutil.pid_exists(p) and _is_spare(psutil.Process(p)) for p in idle), 30,
               what="the spares to exit with the daemon")


@pytest.mark.slow
def test_no_spares_with_spares_0_or_a_fake_agent_command(cluster, tmp_path):
    fake = cluster.daemon("fake", cpu=1)
    job = submit(fake.state_dir, FAKE_SCRIPT, {"FAKE_MODE": "hang"}, "--workers", "1")
    wait_state(fake.state_dir, job, "running")
    assert "no spare agents: the agent command is not `python -m agent`" in fake.output()
    real = cluster.daemon("real", "--spares", "0", cpu=1, fake=False, own_forks=True)
    script = tmp_path / "broken.py"
    script.write_text("raise RuntimeError('broken at import')\n")
    r = cli("submit", str(script), "--workers", "1", "--wait", "--state-dir", str(real.state_dir), timeout=180)
    assert r.code == 1 and "broken at import" in r.err, r
    # Both daemons' loops have run many times by now: a pool that was on would hold a spare.
    for d in (fake, real):
        assert not any(_is_spare(k) for k in d.agents()), [k.cmdline() for k in d.agents()]
        assert "started on spare" not in d.output() and not (d.state_dir / "spares.log").exists()
