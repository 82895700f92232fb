"""A node's agents forked from one warm process (agent/forkserver.py, elasticd/forked.py).

A forked agent must be what a cold `python -m elasticd.agent` would have been: passed descriptors at the
numbers its argv names (a reference rank's), its own name, exit codes and signals as for a Popen child, and a job whose result
is bitwise the cold start's. Real processes throughout: the server imports torch, the agents run the job.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import psutil
import pytest
import torch
import zmq
from util import JOBS, cli, wait_until

from elasticd import protocol as p
from elasticd.agent.proc_name import STANDBY, agents_under
from elasticd.core.agent_config import AgentConfig
from elasticd.core.commands import module_command
from elasticd.forked import ForkServer, supported

pytestmark = pytest.mark.skipif(not supported(), reason="needs Linux pidfds and descriptor passing")
JOB = str(JOBS / "resize_job.py")  # BatchNorm, dropout, AdamW, StepLR, clipping, ctx.private


def _read_event(router: zmq.Socket, timeout_s: float) -> p.Message:
    assert router.poll(int(timeout_s * 1000)), "the forked agent sent nothing"
    return p.decode(router.recv_multipart()[-1])


@pytest.fixture
def server():
    s = ForkServer(dict(os.environ))
    yield s
    s.close()


def test_a_forked_standby_talks_on_its_channel_is_named_and_dies_as_a_popen_child(server: ForkServer,
                                                                                  tmp_path: Path) -> None:
    zctx = zmq.Context()
    router = zctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{tmp_path}/node.sock")
    cfg = AgentConfig(script=JOB, workers=4, rank=0, world=1, control=f"ipc://{tmp_path}/node.sock", standby=True,
                      error_file=str(tmp_path / "err.json"))
    env = {**os.environ, "ELASTICD_TEST_WORKERS": "4"}
    proc = server.spawn(cfg.to_argv(), env, ())
    assert proc is not None, server.broken
    try:
        hello = _read_event(router, 300)
        assert isinstance(hello, p.AgentHello) and hello.info.pid == proc.pid, hello
        child = psutil.Process(proc.pid)
        assert child.ppid() == server._proc.pid   # forked by the server, not started cold
        assert child.name() == STANDBY
        assert [(r, c.pid) for r, c in agents_under(os.getpid())] == [(None, proc.pid)]
        assert proc.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
        proc.kill()   # a dead agent is not signalled again (its pid may be someone else's by now)
    finally:
        router.close(linger=0)
        zctx.term()


def test_exit_codes_come_back_and_startup_variables_start_cold(server: ForkServer) -> None:
    usage = server.spawn(["--no-such-option"], dict(os.environ), ())
    assert usage is not None and usage.wait(timeout=300) == 2   # argparse's usage error, as in a cold agent
    # OpenMP reads its thread count when the library loads: a fork cannot take a different one on.
    assert server.spawn(["--help"], {**os.environ, "OMP_NUM_THREADS": "3"}, ()) is None
    helped = server.spawn(["--help"], dict(os.environ), ())
    assert helped is not None and helped.wait(timeout=60) == 0


def _run(tmp: Path, name: str, env: dict[str, str]) -> dict[str, torch.Tensor]:
    out = tmp / name
    out.mkdir()
    env = {**os.environ, **env, "ELASTICD_TEST_WORKERS": "4", "ELASTICD_TEST_STEPS": "12",
           "ELASTICD_TEST_DETERMINISTIC": "1", "ELASTICD_TEST_LOG": str(out), "ELASTICD_TEST_OUT": str(out / "final.pt")}
    proc = subprocess.run([sys.executable, "-m", "elasticd", "run", JOB, "--devices", "2", "--scale-at", "5:1"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out / "final.pt")


@pytest.mark.slow
def test_forked_agents_compute_bitwise_what_cold_ones_do(tmp_path: Path) -> None:
    forked = _run(tmp_path, "forked", {})
    cold = _run(tmp_path, "cold", {"ELASTICD_FORKSERVER": "0"})
    assert forked.keys() == cold.keys()
    for name, value in forked.items():
        assert torch.equal(value, cold[name]), f"{name}: forked agents differ from cold ones"


def test_each_forked_agent_starts_with_streams_of_its_own(tmp_path: Path) -> None:
    """A fork copies the server's random streams; a fresh interpreter draws its own from the OS. What the
    script's top level draws unseeded (once per agent) must differ between agents, as between processes."""
    out = tmp_path / "draws"
    run = cli("run", str(JOBS / "top_level_draws.py"), "--devices", "2", env={"DRAWS_OUT": str(out)}, timeout=240)
    assert run.code == 0, run.output
    draws = [json.loads(Path(f"{out}{rank}.json").read_text()) for rank in range(4)]
    assert draws[0] == draws[1] and draws[2] == draws[3]   # ranks 0-1 on agent 0, 2-3 on agent 1
    assert all(draws[0][k] != draws[2][k] for k in draws[0]), draws


def _reference(tmp: Path, name: str, env: dict[str, str]) -> tuple[list[dict], dict[str, torch.Tensor]]:
    out = tmp / name
    out.mkdir()
    run = cli("run", str(JOBS / "reference_probe.py"), "--workers", "3", "--ddp",
              env={**env, "ELASTICD_TEST_WORKERS": "3", "ELASTICD_TEST_OUT": str(out)}, timeout=300)
    assert run.code == 0, run.output
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)], torch.load(out / "model.pt")


def test_reference_ranks_are_forked_plain_ddp_processes_computing_what_cold_ones_do(tmp_path: Path) -> None:
    """`elasticd run --ddp` forks its ranks from a server that imported torch only: no elasticd patch may be
    in a rank (the reference must not share the runtime it checks), each rank has its own RANK and unseeded
    streams, and the trained model is bitwise what cold ranks train."""
    forked, forked_model = _reference(tmp_path, "forked", {})
    cold, cold_model = _reference(tmp_path, "cold", {"ELASTICD_FORKSERVER": "0"})
    for seen in (*forked, *cold):
        assert seen["patches"] == [], seen
        assert seen["argv0"] == str(JOBS / "reference_probe.py"), seen   # as `python SCRIPT`
    assert all("elasticd.agent.forkserver" in r["parent"] and "reference" in r["parent"] for r in forked), forked
    assert not any("elasticd.agent.forkserver" in r["parent"] for r in cold), cold
    assert [r["rank"] for r in forked] == [0, 1, 2]
    assert len({r["seed"] for r in forked}) == 3, forked
    assert forked_model.keys() == cold_model.keys()
    assert all(torch.equal(forked_model[k], cold_model[k]) for k in cold_model)


@pytest.mark.slow
def test_a_shared_server_gives_each_launcher_a_server_of_its_own_unless_the_environment_differs(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`forkserver --listen`: each client gets a fork of the warm server (no second torch import), which ends
    with the client; a client whose interpreter-start variables differ starts its own server instead."""
    path = tmp_path / "agent.sock"
    shared = subprocess.Popen([*module_command("elasticd.agent.forkserver"), "--listen", str(path), "agent"])
    try:
        wait_until(path.exists, 300, what="the shared server's socket")
        assert path.stat().st_mode & 0o777 == 0o600
        with caplog.at_level(logging.INFO, logger="elasticd.forked"):
            joined = ForkServer(dict(os.environ), shared=str(path))
        # Why it started a server of its own, if it did (the variables that differ, or the server's silence).
        assert joined._proc is None, caplog.text
        assert psutil.Process(joined.pid).ppid() == shared.pid
        stdin, keep = os.pipe()   # a spare waits for its job on stdin: it stays until killed
        try:
            forked = joined.spawn([], dict(os.environ), (), stdio=[stdin, 1, 2], options={"spare": True})
            assert forked is not None and psutil.Process(forked.pid).ppid() == joined.pid
            forked.kill()
            assert forked.wait(timeout=60) == -signal.SIGKILL
        finally:
            os.close(stdin)
            os.close(keep)
        server = psutil.Process(joined.pid)
        joined.close()
        wait_until(lambda: not server.is_running(), 30, what="the client's server to end with it")
        apart = ForkServer({**os.environ, "OMP_NUM_THREADS": "3"}, shared=str(path))
        try:
            assert apart._proc is not None and psutil.Process(apart.pid).ppid() == os.getpid()
        finally:
            apart.close()
        assert shared.poll() is None
    finally:
        shared.kill()
        shared.wait()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root, to start a server as another user")
def test_a_shared_server_of_another_user_is_not_joined() -> None:
    """A client hands its server the job's environment and descriptors: a socket in the directory whose
    server runs as someone else (root can connect to any socket) is left, and the client starts its own."""
    import pwd

    try:
        other = pwd.getpwnam("elasticd-job")
    except KeyError:
        pytest.skip("no user elasticd-job (scripts/setup.sh creates it)")
    where = Path(tempfile.mkdtemp(prefix="elasticd-shared-"))   # pytest's tmp dirs are root's alone
    os.chown(where, other.pw_uid, other.pw_gid)
    path = where / "agent.sock"
    theirs = subprocess.Popen([*module_command("elasticd.agent.forkserver"), "--listen", str(path), "agent"],
                              user=other.pw_uid, group=other.pw_gid, extra_groups=[], cwd="/")
    try:
        wait_until(lambda: path.exists() or theirs.poll() is not None, 300, what="the other user's server's socket")
        assert theirs.poll() is None, "the other user's server did not start"
        server = ForkServer(dict(os.environ), shared=str(path))
        try:
            assert server._proc is not None and psutil.Process(server.pid).ppid() == os.getpid()
        finally:
            server.close()
    finally:
        theirs.kill()
        theirs.wait()
        shutil.rmtree(where)


def test_a_child_that_ends_before_its_pid_is_read_is_reported_ended(tmp_path: Path) -> None:
    """A fork that exits at once (a launcher's read of N, its teardown now milliseconds) can have its exit
    reported in the same read as its pid: `spawn` must still return it ended, not leave `wait` waiting for
    an exit that was read before the child was known. The peer here speaks the server's protocol
    (agent/forkserver.py) and has sent the pid (with a real child's pidfd) and the exit before the client
    reads its reply: the order a loaded machine produces now and then."""
    path = str(tmp_path / "agent.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    pidfd = os.pidfd_open(child.pid)
    child.wait()   # reaped here, as the server reaps its children; the pidfd stays valid
    peer: list[socket.socket] = []

    def serve() -> None:
        conn, _ = listener.accept()
        peer.append(conn)
        conn.send(json.dumps({"ready": os.getpid(), "env": dict(os.environ)}).encode())
        # the request, once sent, waits unread: the answers are out already
        socket.send_fds(conn, [json.dumps({"pid": child.pid}).encode()], [pidfd])
        os.close(pidfd)
        conn.send(json.dumps({"exit": child.pid, "code": 7}).encode())

    thread = threading.Thread(target=serve)
    thread.start()
    server = ForkServer(dict(os.environ), shared=path)
    try:
        assert server._proc is None, "the client started a server of its own instead of joining the peer"
        thread.join(timeout=30)
        proc = server.spawn(["--anything"], dict(os.environ), [])
        assert proc is not None and proc.pid == child.pid
        assert proc.wait(timeout=10) == 7
    finally:
        server.close()
        for conn in peer:
            conn.close()
        listener.close()
