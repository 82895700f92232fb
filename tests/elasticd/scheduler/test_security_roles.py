"""Roles bound to keys: a key allowed only as a client cannot act as a node, a node
key cannot speak for another node, only a job's owner or an admin may stop or scale it, and a key
allowed before roles existed is read as a client (no silent upgrade of trust).

Everything runs against a real daemon with its embedded scheduler on loopback CURVE TCP."""

from __future__ import annotations

import pytest
from cluster import Cluster, status
from peers import Peer, allow
from util import JOBS, cli, wait_until

from elasticd import keys
from elasticd import protocol as p
from elasticd.scheduler import authz

FAKE_SCRIPT = str(JOBS / "fake_agent.py")


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("roles"))
    d = c.daemon(cpu=2)
    yield d
    c.cleanup()


def hello(node_id: str, devices: int = 8) -> p.NodeHello:
    return p.NodeHello(node_id=node_id, host="10.9.9.9", pid=1, jobs=[],
                       devices=[p.DeviceInfo(device_id=f"cpu:{i}", type="cpu", index=i) for i in range(devices)])


def forbidden(reply: p.Message, *words: str) -> bool:
    return isinstance(reply, p.Error) and reply.code == p.FORBIDDEN and all(w in reply.message for w in words)


def test_a_client_key_cannot_act_as_a_node(node, tmp_path):
    real = node.info()["node_id"]
    laptop = allow(node, tmp_path / "laptop", "--name", "laptop")
    try:
        assert isinstance(laptop.ask(p.Status()), p.StatusReply)          # what a client is for
        for msg in (p.NodeBye(node_id=real), hello("made-up"), p.NodeStatus(node_id=real, seq=1, jobs=[])):
            reply = laptop.ask(msg)
            assert forbidden(reply, "only a node key"), (msg.op, reply)
        laptop.ask(p.NodeBye(node_id=real))   # a second time: refused again, but not logged again
        nodes = status(node.state_dir)["nodes"]
        assert [(n["node_id"], n["alive"]) for n in nodes] == [(real, True)]
        wait_until(lambda: "refused node_bye from key 'laptop' (client)" in node.output(), 10,
                   what="the refusal in the log")
        assert node.output().count("refused node_bye from key 'laptop'") == 1
    finally:
        laptop.close()


def test_a_node_key_speaks_only_for_its_own_node(node, tmp_path):
    real = node.info()["node_id"]
    b = allow(node, tmp_path / "b", "--name", "node-b", "--role", "node", "--node-id", "b")
    try:
        assert forbidden(b.ask(hello(real)), "bound to node 'b'", repr(real))
        assert forbidden(b.ask(p.NodeBye(node_id=real)), "bound to node 'b'")
        assert isinstance(b.ask(hello("b", devices=1)), p.Welcome)
        wait_until(lambda: {n["node_id"] for n in status(node.state_dir)["nodes"]} == {real, "b"}, 10,
                   what="node b to join")
        assert isinstance(b.ask(p.NodeBye(node_id="b")), p.Ok)
    finally:
        b.close()


def test_only_the_owner_or_an_admin_stops_or_scales_a_job(node, tmp_path):
    laptop = allow(node, tmp_path / "laptop2", "--name", "laptop2")
    admin = allow(node, tmp_path / "ops", "--name", "ops", "--role", "admin")
    try:
        r = cli("submit", FAKE_SCRIPT, "--workers", "2", "--max-devices", "1", "--env", "FAKE_MODE=hang",
                "--env", "SECRET_TOKEN=hunter2-value", "--state-dir", str(node.state_dir))
        assert r.code == 0, r.err
        local_job = r.out.strip()
        assert forbidden(laptop.ask(p.Stop(job_id=local_job)), "only its own jobs")
        assert forbidden(laptop.ask(p.Scale(job_id=local_job, devices=1)), "only its own jobs")
        assert forbidden(laptop.ask(p.Logs(job_id=local_job)), "its own jobs")
        # A job not in the table (purged, or never submitted) is nobody's: its logs are not a client's to read.
        assert forbidden(laptop.ask(p.Logs(job_id="j999")), "its own jobs", "no job j999")
        # No alias of another owner's job: an id naming no job must not reach its log folder either.
        for alias in (f".{local_job}", f"..{local_job}", f"{local_job}.", f"{local_job}/"):
            reply = laptop.ask(p.Logs(job_id=alias))
            assert isinstance(reply, p.Error) and reply.code == p.BAD_REQUEST and "job id" in reply.message, reply
        assert forbidden(laptop.ask(p.Shutdown()), "admin key")
        own = laptop.ask(p.Submit(script=FAKE_SCRIPT, workers=1, env={"FAKE_MODE": "hang"}))
        assert isinstance(own, p.Submitted)
        assert isinstance(laptop.ask(p.Stop(job_id=own.job_id)), p.Ok)
        # the --env values never leave the scheduler in a status reply, whoever asks
        assert "hunter2-value" not in repr(laptop.ask(p.Status()))
        assert "hunter2-value" not in cli("status", "--json", "--state-dir", str(node.state_dir)).out
        assert isinstance(admin.ask(p.Stop(job_id=local_job)), p.Ok)
        assert status(node.state_dir, local_job)["jobs"][0]["state"] == "stopped"
    finally:
        laptop.close()
        admin.close()


def test_a_key_allowed_before_roles_existed_is_a_client(node, tmp_path):
    old = tmp_path / "old"
    pub = keys.ensure_identity(old)[0].decode()
    legacy = keys.allowed_dir(node.state_dir) / "old-node.key"   # the format written before roles
    legacy.write_text(f'# elasticd allowed client key\nmetadata\ncurve\n    public-key = "{pub}"\n')
    legacy.chmod(0o600)
    peer = Peer(node, old)
    try:
        assert isinstance(peer.ask(p.Status()), p.StatusReply)
        assert forbidden(peer.ask(hello("old-node")), "only a node key", "--role node")
        wait_until(lambda: "old-node.key has no role" in node.output(), 10, what="the migration warning")
    finally:
        peer.close()


def test_authz_table_closes_ops_it_does_not_name():
    client = authz.Principal(owner="K", role=keys.CLIENT, name="k")
    node = authz.Principal(owner="N", role=keys.NODE, name="n", node_id="n1")
    admin = authz.Principal(owner="A", role=keys.ADMIN, name="a")
    assert authz.check(client, p.Status()) is None
    assert authz.check(client, p.Stop(job_id="j1"), job_owner="K") is None
    assert authz.check(client, p.Stop(job_id="j1"), job_owner="") is not None    # a row older than owners
    assert authz.check(node, p.Submit(script="/x", workers=1)) is None             # relayed from its CLI
    assert authz.check(node, p.Stop(job_id="j1"), job_owner="K") is not None
    assert authz.check(node, p.Logs(job_id="j1"), job_owner="K") is None          # `logs` gathers from nodes
    assert authz.check(client, p.Logs(job_id="j1"), job_owner="N") is not None
    assert authz.check(admin, p.NodeBye(node_id="n1")) is not None                 # admin is not a node
    assert authz.check(admin, p.Stop(job_id="j1"), job_owner="K") is None
    assert authz.check(authz.LOCAL, p.NodeHello(node_id="any", host="", pid=1, devices=[], jobs=[])) is None
    # any node-protocol message is bound to the node id, including ones the scheduler does not serve
    assert "only a node key" in authz.check(admin, p.KillJob(job_id="j1", reason=""))
    # an op the table does not name (here: a reply type) is admin-only
    assert "admin key" in authz.check(client, p.Ok())
    assert "admin key" in authz.check(node, p.Shutdown())
    # a node drains itself when SIGTERMed with a grace period (elasticd.daemon.grace), and only itself
    assert authz.check(node, p.Drain(node_id="n1", deadline_s=30.0)) is None
    assert "may not drain node 'n2'" in authz.check(node, p.Drain(node_id="n2"))
    assert "admin key" in authz.check(client, p.Drain(node_id="n1"))
    assert authz.check(admin, p.Undrain(node_id="n1")) is None


def test_a_node_allowed_without_a_role_is_told_how_to_migrate(tmp_path):
    c = Cluster(tmp_path)
    try:
        a = c.daemon("a", cpu=1)
        b_dir = tmp_path / "b"
        doc = cli("keygen", "--state-dir", str(b_dir), "--json").json()   # the key, and the id b will use
        pub, b_id = doc["public_key"], doc["node_id"]
        legacy = keys.allowed_dir(a.state_dir) / "node-b.key"   # allowed the way it was done before roles
        legacy.write_text(f'# elasticd allowed client key\nmetadata\ncurve\n    public-key = "{pub}"\n')
        legacy.chmod(0o600)
        b = c.daemon("b", "--scheduler", a.info()["scheduler_tcp"], "--scheduler-key",
                     str(a.state_dir / "keys" / "id.key"), cpu=1)
        assert b.info()["node_id"] == b_id
        hint = "scheduler error: forbidden: key 'node-b' (client) may not send node_hello"
        wait_until(lambda: hint in b.output() and "--role node --node-id ID" in b.output(), 10,
                   what="the refusal, with the command that fixes it, in node b's log")
        # the hello is repeated every heartbeat (0.1 s here); each side logs the refusal once
        wait_until(lambda: a.output().count("refused node_hello from key 'node-b'") == 1
                   and "node_hello from key 'node-b' (client) refused again" in a.output(), 10)
        assert b.output().count(hint) == 1
        assert [n["node_id"] for n in status(a.state_dir)["nodes"]] == [a.info()["node_id"]]
        # the migration: allowed again with a role, the same running node joins
        assert cli("keygen", "--state-dir", str(a.state_dir), "--allow", pub, "--name", "node-b", "--role", "node",
                   "--node-id", b_id).code == 0
        wait_until(lambda: len(status(a.state_dir)["nodes"]) == 2, 20, what="node b to join once re-allowed")
    finally:
        c.cleanup()


def test_another_owners_error_text_is_hidden_from_a_client_and_from_the_open_http_page(node, tmp_path):
    """An error message or traceback is user text (paths, data, a secret in an exception): a client sees what
    failed where in another owner's job, not that text; the owner (here the local admin) and admins do."""
    laptop = allow(node, tmp_path / "laptop3", "--name", "laptop3")
    try:
        r = cli("submit", FAKE_SCRIPT, "--workers", "1", "--env", "FAKE_MODE=fail", "--state-dir", str(node.state_dir))
        assert r.code == 0, r.err
        job = r.out.strip()
        wait_until(lambda: status(node.state_dir, job)["jobs"][0]["state"] == "failed", 60, what="the failure")
        mine = status(node.state_dir, job)["jobs"][0]["error"]
        theirs = laptop.ask(p.Status(job_id=job)).jobs[0].error
        listed = next(j for j in laptop.ask(p.Status()).jobs if j.job_id == job).error
        assert "fake" in mine["message"] and "traceback" in mine, mine
        for seen in (theirs, listed):
            assert seen["cause"] == mine["cause"] and "traceback" not in seen, seen
            assert seen["message"].startswith("hidden: the error of another owner's job"), seen
    finally:
        laptop.close()
    # The status page's rows (served without authentication) carry the cause and where to look, no text.
    from elasticd.observe.snapshot import job_row
    from elasticd.scheduler.state import SchedulerState

    s = SchedulerState([], now=0.0)
    job, _ = s.submit(p.Submit(script="/x.py", workers=1), 0.0)
    job.error = {"cause": "user", "message": "ValueError: password=hunter2", "traceback": "..."}
    assert job_row(job)["error"] == f"failed (user): elasticd status {job.job_id}"
