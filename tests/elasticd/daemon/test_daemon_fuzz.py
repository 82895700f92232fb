"""Hostile input against every socket of a running daemon: garbage, garbled and wrong-version frames,
random field values, oversized and multi-frame messages, raw TCP bytes, and clients whose CURVE key
is not allowed. The daemon must answer what it can with typed errors and keep serving."""

from __future__ import annotations

import dataclasses
import os
import random
import socket
import stat
from pathlib import Path

import msgpack
import pytest
import zmq
from cluster import Cluster, status
from util import cli, wait_until

from elasticd import keys, transport
from elasticd import protocol as p

N_FRAMES = 1000
SKIP_OPS = {"shutdown"}   # a well-formed shutdown on the owner-only socket is a legitimate request


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("fuzz"))
    d = c.daemon(cpu=1)
    yield d
    c.cleanup()


def _value(rng: random.Random, depth: int = 0):
    kind = rng.randrange(9 if depth < 2 else 6)
    return [lambda: rng.randint(-2**40, 2**40), lambda: rng.random() * 1e6, lambda: None, lambda: rng.random() < .5,
            lambda: "".join(chr(rng.randrange(32, 0x2FF)) for _ in range(rng.randrange(12))),
            lambda: rng.randbytes(rng.randrange(8)),
            lambda: [_value(rng, depth + 1) for _ in range(rng.randrange(3))],
            lambda: {str(rng.randrange(5)): _value(rng, depth + 1) for _ in range(rng.randrange(3))},
            lambda: {"device_id": "cpu:0", "type": "cpu", "index": 0}][kind]()


def frames(seed: int) -> list[tuple[list[bytes], int]]:
    """(frames, rid expected on the reply): reply rid 0 when the frame carries none."""
    rng = random.Random(seed)
    ops = [op for op in p.registered_ops() if op not in SKIP_OPS]
    valid = p.Status(job_id=None).encode()
    out: list[tuple[list[bytes], int]] = []
    for i in range(N_FRAMES):
        rid = 1000 + i
        k = i % 10
        if k == 0:
            out.append(([rng.randbytes(rng.randrange(0, 300))], 0))
        elif k == 1:
            out.append(([msgpack.packb(_value(rng))], 0))
        elif k == 2:
            out.append(([msgpack.packb({"v": rng.choice([0, 2, "1", None, 1.0]), "op": "status", "rid": rid})], rid))
        elif k == 3:
            out.append(([msgpack.packb({"v": p.PROTOCOL_VERSION, "op": rng.choice(["nope", "", 7, None]), "rid": rid})], rid))
        elif k in (4, 5, 6):
            cls = p.registered_ops()[rng.choice(ops)]
            body = {"v": p.PROTOCOL_VERSION, "op": cls.op, "rid": rid}
            for f in dataclasses.fields(cls):
                if f.name != "rid" and rng.random() < 0.8:
                    body[f.name] = _value(rng)
            if rng.random() < 0.2:
                body["extra"] = 1
            out.append(([msgpack.packb(body, use_bin_type=True)], rid))
        elif k == 7:
            b = bytearray(valid)
            for _ in range(rng.randrange(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            out.append(([bytes(b[: rng.randrange(1, len(b) + 1)])], -1))  # may even stay valid
        elif k == 8:
            out.append(([valid, rng.randbytes(5)], 0))
        else:
            out.append(([msgpack.packb({"v": p.PROTOCOL_VERSION, "op": "status", "rid": rid, "job_id": "x" * rng.randrange(50)})], rid))
    out.append(([b"\x00" * (2 * p.MAX_FRAME_BYTES)], 0))   # oversized but under the transport cap
    return out


def blast(endpoint: str, seed: int, curve: tuple[tuple[bytes, bytes], bytes] | None = None) -> dict[str, int]:
    """Send every frame in turn, waiting for its answer; returns error codes seen."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    if curve:
        transport.curve_client(s, *curve)
    s.connect(endpoint)
    codes: dict[str, int] = {}
    try:
        for fr, rid in frames(seed):
            s.send_multipart(fr)
            while True:
                assert s.poll(5000), f"no answer to {fr[0][:60]!r}"
                reply = p.decode(s.recv())
                if rid == -1 or reply.rid == max(rid, 0):
                    break
            if isinstance(reply, p.Error):
                codes[reply.code] = codes.get(reply.code, 0) + 1
    finally:
        s.close()
        ctx.term()
    return codes


def assert_serving(d, ident=None):
    assert d.popen.poll() is None, d.output()[-3000:]
    assert status(d.state_dir)["nodes"][0]["alive"]


def test_garbage_on_the_cli_socket(node):
    codes = blast(transport.ipc_endpoint(node.state_dir / "daemon.sock"), seed=1)
    assert codes[p.BAD_FRAME] >= 100 and codes[p.VERSION_MISMATCH] >= 50 and codes[p.UNKNOWN_OP] >= 50
    assert codes[p.BAD_REQUEST] >= 100 and codes[p.TOO_LARGE] == 1
    assert_serving(node)


def test_garbage_on_the_agent_socket(node):
    codes = blast(node.info()["agents"], seed=2)
    assert codes[p.BAD_FRAME] >= 100 and codes[p.BAD_REQUEST] >= 100
    assert_serving(node)


def test_garbage_on_the_scheduler_tcp_socket_from_an_allowed_client(node):
    ident = keys.load_identity(node.state_dir)
    server = keys.parse_public_key(str(node.state_dir / "keys" / "id.key"))
    codes = blast(node.info()["scheduler_tcp"], seed=3, curve=(ident, server))
    assert codes[p.BAD_FRAME] >= 100 and codes[p.BAD_REQUEST] >= 100
    assert_serving(node)


def test_raw_bytes_on_the_tcp_port_are_dropped(node):
    host, port = node.info()["scheduler_tcp"][len("tcp://"):].rsplit(":", 1)
    rng = random.Random(4)
    for _ in range(50):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(rng.randbytes(rng.randrange(1, 2000)))
            s.settimeout(5)
            try:
                while s.recv(4096):
                    pass
            except (ConnectionResetError, TimeoutError):
                pass
    assert_serving(node)


def test_client_with_a_key_not_on_the_allow_list_is_refused_until_allowed(node, tmp_path):
    stranger = tmp_path / "stranger"
    pub = cli("keygen", "--state-dir", str(stranger)).out.strip()
    args = ["status", "--endpoint", node.info()["scheduler_tcp"], "--server-key",
            str(node.state_dir / "keys" / "id.key"), "--state-dir", str(stranger), "--timeout", "5"]
    r = cli(*args)
    assert r.code == 3 and "refused" in r.err and "allow-list" in r.err, (r.code, r.err)
    r = cli(*args, "--json")
    assert r.code == 3 and r.json()["code"] == "unreachable"
    wait_until(lambda: "refused CURVE client " + pub in node.output(), 10, what="the refusal in the daemon log")
    assert cli("keygen", "--state-dir", str(node.state_dir), "--allow", pub).code == 0
    r = cli(*args)
    assert r.code == 0 and "NODE" in r.out, (r.code, r.err)
    # and a client that does not know the right server key cannot talk either
    wrong = cli("keygen", "--state-dir", str(tmp_path / "other")).out.strip()
    r = cli(*args[:3], "--server-key", wrong, "--state-dir", str(stranger), "--timeout", "2")
    assert r.code == 3


def test_version_mismatch_is_refused_loudly(node):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(transport.ipc_endpoint(node.state_dir / "daemon.sock"))
    s.send(msgpack.packb({"v": p.PROTOCOL_VERSION + 1, "op": "status", "rid": 7}))
    assert s.poll(5000)
    reply = p.decode(s.recv())
    s.close(linger=0)
    ctx.term()
    assert isinstance(reply, p.Error) and reply.code == p.VERSION_MISMATCH and reply.rid == 7
    assert f"version {p.PROTOCOL_VERSION + 1}" in reply.message
    wait_until(lambda: "refused a peer: peer speaks protocol version" in node.output(), 10, what="warning in log")


def test_ipc_sockets_and_secrets_are_owner_only(node):
    for name in ("daemon.sock", "keys/id.key_secret"):
        assert (Path(node.state_dir) / name).stat().st_mode & 0o077 == 0, name
    assert Path(node.state_dir).stat().st_mode & 0o077 == 0
    # The agent socket lives in the agents' area outside the state dir. A root daemon runs jobs as other users,
    # who must reach it: any local user may connect there, and a hello binds only with an agent's own token.
    sock = Path(node.info()["agents"].removeprefix("ipc://"))
    area = sock.parent.stat()
    assert area.st_uid == os.geteuid() and Path(node.state_dir) not in sock.parents
    if os.geteuid() == 0:
        assert (stat.S_IMODE(sock.stat().st_mode), stat.S_IMODE(area.st_mode)) == (0o666, 0o711)
    else:
        assert (stat.S_IMODE(sock.stat().st_mode), stat.S_IMODE(area.st_mode)) == (0o600, 0o700)


ROGUE_AGENT_JOB = '''
import time

import msgpack

import elasticd


@elasticd.elastic(workers=1)
def train(ctx):
    # A job reaching for its agent's own connection to the daemon (it said hello already) and sending a
    # well-formed frame whose op no daemon knows.
    control = ctx._rt.control
    with control._lock:
        control._sock.send(msgpack.packb({"v": VERSION, "op": "launch_missiles"}))
    for _ in ctx.steps(6000):
        time.sleep(0.01)   # a minute: only the daemon ends it
'''


def test_an_agents_unreadable_message_fails_its_job_by_name_and_the_daemon_serves_on(tmp_path):
    """What a job sends on its agent's connection is untrusted: a frame that is no agent message is not
    guessed at. The job fails naming it (a user's error: no restart) and the daemon keeps serving."""
    c = Cluster(tmp_path / "c")
    try:
        d = c.daemon(cpu=1, fake=False)
        script = tmp_path / "rogue.py"
        script.write_text(ROGUE_AGENT_JOB.replace("VERSION", str(p.PROTOCOL_VERSION)))
        r = cli("submit", str(script), "--state-dir", str(d.state_dir))
        assert r.code == 0, r.output
        job = r.out.strip()

        def ended():
            info = status(d.state_dir, job)["jobs"][0]
            return info if info["state"] in ("failed", "finished", "stopped") else None
        info = wait_until(ended, 120, what="the rogue job to end")
        assert info["state"] == "failed", info
        assert info["error"]["message"] == ("stopping the job: unreadable message from agent 0: unknown op "
                                            "'launch_missiles'"), info["error"]
        assert info["recoveries"] == [], info   # the job's doing: not restarted
        assert status(d.state_dir)["nodes"][0]["alive"]
    finally:
        c.cleanup()
