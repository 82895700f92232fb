"""Jobs never run as the daemon's identity: a daemon running as root runs each job as the user its owner's
key maps to (`keygen --allow KEY --run-as USER`), or as the node's `--jobs-as` user, and such a job reaches
neither the daemon's keys, nor `daemon.sock` (where a peer is admin), nor another job's logs, processes or
files, nor another job's agent on the agent socket (each agent proves itself with its own token).

The end-to-end tests need root and the unprivileged user `elasticd-job` (scripts/setup.sh creates it);
elsewhere they are skipped with that reason. The rules below them run anywhere. Their daemons start their
own spares' fork servers (`own_forks`), as a production daemon does, not the test process's shared one."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import stat
import tempfile
from pathlib import Path

import pytest
from cluster import status, wait_state
from util import REPO, cli, wait_until

from elasticd import keys
from elasticd import protocol as p
from elasticd.core.files import read_regular
from elasticd.daemon import job_user
from elasticd.scheduler import authz

JOB_USER = job_user.DEFAULT_JOB_USER


def _job_user_missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root: only a daemon running as root runs jobs as other users"
    try:
        pwd.getpwnam(JOB_USER)
    except KeyError:
        return f"needs the user {JOB_USER} (scripts/setup.sh creates it when run as root)"
    return None


needs_job_user = pytest.mark.skipif(_job_user_missing() is not None, reason=str(_job_user_missing()))

# What a hostile job tries, as the user it runs as; every attempt's outcome is printed as one JSON line.
PROBE = r'''
import json, os, pwd, socket, sys
import zmq
from elasticd import protocol as p

state, area, victim, victim_pid, me = (os.environ[k] for k in ("STATE", "AREA", "VICTIM", "VICTIM_PID", "ELASTICD_JOB_ID"))
out = {"user": pwd.getpwuid(os.geteuid()).pw_name, "home": os.environ.get("HOME"),
       "token_in_env": "ELASTICD_AGENT_TOKEN" in os.environ}

def attempt(name, fn):
    try:
        fn()
        out[name] = "done"
    except OSError as e:
        out[name] = type(e).__name__

attempt("read_admin_key", lambda: open(os.path.join(state, "keys", "id.key_secret")).read())
attempt("open_daemon_sock", lambda: socket.socket(socket.AF_UNIX).connect(os.path.join(state, "daemon.sock")))
attempt("read_victim_log", lambda: open(os.path.join(state, "logs", victim, "rank0.log")).read())
attempt("list_agent_area", lambda: os.listdir(area))
attempt("write_victim_dir", lambda: open(os.path.join(area, victim, "planted"), "w").write("x"))
attempt("signal_victim", lambda: os.kill(int(victim_pid), 0))
attempt("write_own_dir", lambda: open(os.path.join(area, me, "mine"), "w").write("x"))

# Speak for the victim's agent on the agent socket: its job, rank and pid are no secret, its token is.
ctx = zmq.Context()
s = ctx.socket(zmq.DEALER)
s.connect("ipc://" + os.path.join(area, "agents.sock"))
info = p.AgentInfo(world=1, hosted=[0, 1, 2, 3], pid=int(victim_pid), host="h", device="cpu")
s.send(p.AgentHello(job_id=victim, rank=0, info=info, token="0" * 32).encode())
out["impersonate"] = p.decode(s.recv()).message if s.poll(10000) else "no answer"
s.send(p.AgentFailed(job_id=victim, rank=0, error=p.AgentError(message="forged")).encode())
out["forge_failure"] = p.decode(s.recv()).message if s.poll(10000) else "no answer"
print("PROBE " + json.dumps(out), flush=True)
'''


@pytest.fixture
def shared_dir():
    """A directory the job's user can read (pytest's tmp dirs are root's only)."""
    d = Path(tempfile.mkdtemp(prefix="elasticd-run-as-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _agent_pid(sd: Path, job: str) -> int:
    agents = status(sd, job)["jobs"][0]["agents"]
    return agents[0]["pid"] if agents and agents[0]["pid"] else 0


@needs_job_user
@pytest.mark.parametrize("spares", ["0", "1"], ids=["cold", "spare"])
def test_a_job_run_as_another_user_reaches_no_key_socket_log_process_or_agent_of_anyone_else(cluster, shared_dir,
                                                                                             spares):
    """A root daemon (`--jobs-as elasticd-job`), an admin's job run as root (the victim), and a hostile job
    run as elasticd-job, started cold (Popen(user=...)) or on a warm spare (which drops to the user after
    opening its log). The hostile job cannot read the admin key, open daemon.sock, read the victim's log,
    list the agents' area, write into the victim's directory, signal the victim's agent, or speak for it on
    the agent socket; it can write into its own directory, runs as elasticd-job with its home, and never
    sees its agent token. The victim keeps training throughout."""
    d = cluster.daemon("node", "--jobs-as", JOB_USER, "--spares", spares, cpu=2, fake=False, own_forks=True)
    sd = d.state_dir
    assert f"jobs run as {JOB_USER}" in d.output()
    victim = cli("submit", str(REPO / "examples" / "train_mlp.py"), "--max-devices", "1", "--run-as", "root",
                 "--env", "TRAIN_STEPS=1000000", "--state-dir", str(sd), cwd=REPO)
    assert victim.code == 0, victim.err
    victim_id = victim.out.strip()
    wait_state(sd, victim_id, "running")
    pid = wait_until(lambda: _agent_pid(sd, victim_id), 60, what="the victim's agent pid")
    script = shared_dir / "probe.py"
    script.write_text(PROBE)
    script.chmod(0o644)
    area = Path(d.info()["agents"].removeprefix("ipc://")).parent
    env = {"STATE": str(sd), "AREA": str(area), "VICTIM": victim_id, "VICTIM_PID": str(pid)}
    probe = cli("submit", str(script), "--workers", "1", *(x for k, v in env.items() for x in ("--env", f"{k}={v}")),
                "--state-dir", str(sd), cwd=shared_dir)
    assert probe.code == 0, probe.err
    probe_id = probe.out.strip()
    info = wait_state(sd, probe_id, ("finished", "failed"), timeout=120)
    logs = cli("logs", probe_id, "--state-dir", str(sd)).out
    assert info["state"] == "finished", (info["error"], logs[-3000:])
    line = next(x for x in logs.splitlines() if "PROBE " in x)
    got = json.loads(line.split("PROBE ", 1)[1])
    home = pwd.getpwnam(JOB_USER).pw_dir
    assert got == {"user": JOB_USER, "home": home, "token_in_env": False,
                   "read_admin_key": "PermissionError", "open_daemon_sock": "PermissionError",
                   "read_victim_log": "PermissionError", "list_agent_area": "PermissionError",
                   "write_victim_dir": "PermissionError", "signal_victim": "PermissionError",
                   "write_own_dir": "done",
                   "impersonate": f"not agent 0 of job {victim_id}: wrong token",
                   "forge_failure": "say agent_hello first"}, got
    assert not (area / victim_id / "planted").exists()
    before = status(sd, victim_id)["jobs"][0]
    assert before["state"] == "running" and before["error"] is None and before["run_as"] == "root"
    assert "(runs as root)" in cli("status", victim_id, "--state-dir", str(sd)).out
    wait_until(lambda: status(sd, victim_id)["jobs"][0]["step"] > before["step"], 60, what="the victim to train on")
    assert cli("stop", victim_id, "--state-dir", str(sd)).code == 0


@needs_job_user
def test_a_client_keys_jobs_run_as_the_user_it_maps_to_over_tcp(cluster, shared_dir):
    """The daemon's default is root here (`--jobs-as root`), the client key is allowed `--run-as
    elasticd-job`: its job, submitted over CURVE TCP, runs as elasticd-job; the same key naming another
    user is refused."""
    d = cluster.daemon("node", "--jobs-as", "root", "--bind", "tcp://127.0.0.1:0", cpu=1, fake=False, own_forks=True)
    sd, client = d.state_dir, shared_dir / "client"
    key = cli("keygen", "--state-dir", str(client)).out.strip()
    assert cli("keygen", "--state-dir", str(sd), "--allow", key, "--name", "alice", "--run-as", JOB_USER).code == 0
    remote = ("--state-dir", str(client), "--endpoint", d.info()["scheduler_tcp"],
              "--server-key", str(sd / "keys" / "id.key"))
    script = shared_dir / "whoami.py"
    script.write_text("import os, pwd\nprint('RUNS AS', pwd.getpwuid(os.geteuid()).pw_name, flush=True)\n")
    script.chmod(0o644)
    r = cli("submit", str(script), "--workers", "1", *remote, cwd=shared_dir)
    assert r.code == 0, r.err
    job = r.out.strip()
    assert wait_state(sd, job, ("finished", "failed"), timeout=120)["state"] == "finished"
    assert f"RUNS AS {JOB_USER}" in cli("logs", job, *remote).out
    refused = cli("submit", str(script), "--workers", "1", "--run-as", "root", *remote, cwd=shared_dir)
    assert refused.code == 1 and "may not choose the user its job runs as" in refused.err, refused.err


@needs_job_user
def test_a_job_whose_user_cannot_read_its_script_fails_with_the_reason(cluster, tmp_path):
    """The script sits in root's 0700 tmp dir: the job run as elasticd-job fails, and says why."""
    d = cluster.daemon("node", "--jobs-as", JOB_USER, cpu=1, fake=False, own_forks=True)
    script = tmp_path / "job.py"
    script.write_text("print('hello')\n")
    r = cli("submit", str(script), "--workers", "1", "--state-dir", str(d.state_dir), cwd=REPO)
    assert r.code == 0, r.err
    info = wait_state(d.state_dir, r.out.strip(), ("finished", "failed"), timeout=120)
    assert info["state"] == "failed"
    assert "Permission denied" in json.dumps(info["error"]) + cli("logs", r.out.strip(), "--state-dir",
                                                                    str(d.state_dir)).out


@needs_job_user
def test_a_job_submitted_from_a_directory_its_user_cannot_enter_fails_at_once_with_the_reason(cluster, shared_dir,
                                                                                              tmp_path):
    """Submitted from root's 0700 tmp dir, on a spare or cold alike: the launch fails, naming the directory,
    rather than agents dying one by one and the job being recovered as if a node had failed."""
    d = cluster.daemon("node", "--jobs-as", JOB_USER, cpu=1, fake=False, own_forks=True)
    script = shared_dir / "job.py"
    script.write_text("print('hello')\n")
    script.chmod(0o644)
    r = cli("submit", str(script), "--workers", "1", "--state-dir", str(d.state_dir), cwd=tmp_path)
    assert r.code == 0, r.err
    info = wait_state(d.state_dir, r.out.strip(), ("finished", "failed"), timeout=120)
    assert info["state"] == "failed" and not info["recoveries"], info
    assert "cannot enter its working directory" in info["error"]["message"], info["error"]


def test_a_root_daemon_without_its_job_user_refuses_to_start_and_says_how_to_fix_it(cluster):
    if os.geteuid() != 0:
        pytest.skip("needs root: a daemon that is not root runs jobs as itself")
    r = cli("start", "--state-dir", str(cluster.root / "n"), "--jobs-as", "no-such-user-x", "--bind", "none")
    assert r.code != 0 and "no user 'no-such-user-x' on this machine" in r.err, r.err


def test_a_daemon_that_is_not_root_runs_jobs_only_as_itself():
    if os.geteuid() == 0:
        me = job_user.node_default("root")
        assert not me.switched and me.name == "root"
        return
    with pytest.raises(job_user.JobUserError, match="can run jobs only as itself"):
        job_user.node_default("root")
    assert job_user.node_default(None) == job_user.own()


def test_a_client_key_runs_its_jobs_as_its_user_and_cannot_choose_another(tmp_path):
    keys.ensure_identity(tmp_path)
    public, _ = keys.ensure_identity(tmp_path / "c")
    keys.allow_key(tmp_path, public, "alice", run_as="alice")
    grant = keys.allowed_grants(tmp_path)[public]
    assert grant.run_as == "alice"
    who = authz.principal_of(public.decode(), grant)
    job = p.Submit(script="/s.py", workers=1)
    assert authz.check(who, job) is None and authz.run_as(who, job) == "alice"
    root = p.Submit(script="/s.py", workers=1, run_as="root")
    assert "may not choose the user its job runs as" in authz.check(who, root)
    assert authz.check(authz.LOCAL, root) is None and authz.run_as(authz.LOCAL, root) == "root"
    with pytest.raises(keys.BadKeyError, match="a node key submits no jobs"):
        keys.allow_key(tmp_path, public, "n1", role=keys.NODE, node_id="n1", run_as="alice")
    with pytest.raises(keys.BadKeyError, match="user name"):
        keys.allow_key(tmp_path, public, "bad", run_as="-rf")
    assert p.Submit(script="/s.py", workers=1, run_as="a b").check().startswith("run_as: user name")


def test_the_daemon_reads_an_agents_files_only_as_regular_files_of_the_agents_user(tmp_path):
    """A job owns its directory: a link to a root file, a FIFO or another user's file in the place of its
    error report are not read (and the FIFO does not block the daemon)."""
    me = os.geteuid()
    good = tmp_path / "rank0.json"
    good.write_text('{"message": "boom"}')
    assert read_regular(good, 1 << 20, owner=me) == b'{"message": "boom"}'
    assert read_regular(good, 4, owner=me) == b'{"me'
    assert read_regular(good, 1 << 20, owner=me + 1) is None      # not the agent's user's file
    link = tmp_path / "rank1.json"
    link.symlink_to("/etc/passwd")
    assert read_regular(link, 1 << 20, owner=me) is None
    fifo = tmp_path / "rank2.json"
    os.mkfifo(fifo)
    assert read_regular(fifo, 1 << 20, owner=me) is None
    assert read_regular(tmp_path / "missing.json", 1 << 20, owner=me) is None
    from elasticd.core.watchdog import read_beat
    assert read_beat(str(fifo)) is None and read_beat(str(link)) is None


def test_the_agents_area_must_be_the_daemons_own(tmp_path):
    """/dev/shm is writable by everyone: a directory someone else made in the area's place is refused."""
    from elasticd.daemon.processes import open_agent_root
    from elasticd.statedir import StateDir, UnsafeStateDir

    sd = StateDir(tmp_path / "state").create()
    root = open_agent_root(sd, shared=False, now=0.0)
    try:
        assert stat.S_IMODE(root.stat().st_mode) == 0o700 and root.stat().st_uid == os.geteuid()
        if os.geteuid() == 0:
            os.chown(root, 12345, 12345)
            with pytest.raises(UnsafeStateDir, match="owned by uid 12345"):
                open_agent_root(sd, shared=True, now=0.0)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    root.symlink_to(tmp_path)
    try:
        with pytest.raises(UnsafeStateDir, match="not a directory"):
            open_agent_root(sd, shared=False, now=0.0)
    finally:
        root.unlink()


def test_blocked_at_names_the_first_directory_a_user_cannot_pass(shared_dir):
    """What the daemon's start-up check and setup.sh rely on: the first directory on the way to a file that a
    user (here one that owns nothing) may not pass through; o+x alone opens it."""
    stranger = job_user.JobUser("stranger", 54321, 54321, (54321,), "/nonexistent")
    closed = shared_dir / "closed"
    (closed / "inner").mkdir(parents=True)
    closed.chmod(0o700)
    target = closed / "inner" / "file.py"
    assert job_user.blocked_at(str(target), stranger) == str(closed)
    closed.chmod(0o711)
    assert job_user.blocked_at(str(target), stranger) is None
    assert [what for what, _ in job_user.runnable_paths()] == [
        "the Python interpreter", "its standard library", "the installed packages", "elasticd"]
