"""A flood of client requests cannot cost a node its membership: the daemon relays at most
MAX_IN_FLIGHT_PER_PEER requests of one local client (MAX_IN_FLIGHT in all) to the scheduler and answers the
rest `busy` at once; the scheduler serves nodes' messages before the client requests queued with them, and
each client key gets KEY_RATE requests a second (KEY_BURST at once). Bounded in count and time, loopback only."""

from __future__ import annotations

import collections
import time

import zmq
from cluster import status
from daemon_jobs import submit_fake
from peers import allow
from util import cli, wait_until

from elasticd import protocol as p
from elasticd import transport
from elasticd.daemon.server import MAX_IN_FLIGHT_PER_PEER
from elasticd.scheduler.admission import KEY_BURST, KEY_RATE, KeyBudget

FLOOD = 3000


def _fire(sock: zmq.Socket, n: int) -> collections.Counter:
    """Send `n` status requests without waiting, then read every answer (none may be lost)."""
    for rid in range(1, n + 1):
        sock.send(p.Status(rid=rid).encode())
    got: collections.Counter = collections.Counter()
    seen = set()
    deadline = time.monotonic() + 120
    while len(seen) < n:
        assert sock.poll(max(1, int((deadline - time.monotonic()) * 1000))), f"{n - len(seen)} requests unanswered"
        reply = p.decode(sock.recv())
        seen.add(reply.rid)
        got[reply.code if isinstance(reply, p.Error) else type(reply).__name__] += 1
    return got


def test_a_status_flood_over_the_ipc_socket_leaves_the_node_alive_and_the_cli_answering(cluster):
    """3000 status requests fired at daemon.sock without waiting for answers: each is answered (a status or
    `busy`), the node is never declared lost (timeout 3 s here), its job keeps running, and a `status`
    right after answers at once."""
    d = cluster.daemon("node", "--node-timeout", "3", cpu=1)
    sd = d.state_dir
    job = submit_fake(sd, "--workers", "1", FAKE_MODE="hang", FAKE_STEP_S="0.05")
    wait_until(lambda: status(sd, job)["jobs"][0]["step"] > 0, 60, what="the job to step")
    ctx = zmq.Context()
    sock = transport.dealer(ctx, immediate=False)
    sock.connect(transport.ipc_endpoint(sd / "daemon.sock"))
    try:
        got = _fire(sock, FLOOD)
    finally:
        sock.close(linger=0)
        ctx.term()
    assert got["StatusReply"] >= MAX_IN_FLIGHT_PER_PEER and got[p.BUSY] > 0, got
    assert sum(got.values()) == FLOOD and set(got) == {"StatusReply", p.BUSY}, got
    t0 = time.monotonic()
    after = status(sd)
    assert time.monotonic() - t0 < 10
    assert [n["alive"] for n in after["nodes"]] == [True]
    assert {j["job_id"]: j["state"] for j in after["jobs"]} == {job: "running"}
    events = cli("events", "--json", "--state-dir", str(sd))
    assert "node_lost" not in events.out, events.out[-2000:]
    assert cli("stop", job, "--state-dir", str(sd)).code == 0


def test_a_client_key_flooding_the_scheduler_over_tcp_is_slowed_and_the_node_stays(cluster, tmp_path):
    """A client key fires 1500 status requests over CURVE TCP: beyond its burst it is answered `busy`, the
    node beside it stays alive, and a request after a second's pause is served again."""
    d = cluster.daemon("node", "--node-timeout", "3", cpu=1)
    peer = allow(d, tmp_path / "flooder", "--name", "flooder")
    try:
        got = _fire(peer.sock, 1500)
        assert got[p.BUSY] > 0 and KEY_BURST <= got["StatusReply"] < 1500, got
        assert [n["alive"] for n in status(d.state_dir)["nodes"]] == [True]
        wait_until(lambda: isinstance(peer.ask(p.Status()), p.StatusReply), 10, interval=0.5,
                   what="the key to be served again")
    finally:
        peer.close()


def test_key_budget_refills_at_its_rate_and_forgets_keys_beyond_its_table():
    b = KeyBudget(rate=KEY_RATE, burst=KEY_BURST)
    assert sum(b.take("a", 0.0) for _ in range(int(KEY_BURST) * 2)) == KEY_BURST
    assert not b.take("a", 0.0) and b.take("b", 0.0)           # one key's flood costs another nothing
    assert sum(b.take("a", 1.0) for _ in range(int(KEY_RATE) * 2)) == KEY_RATE
    for i in range(5000):
        b.take(f"k{i}", 2.0)
    assert len(b._tokens) <= 4096


def test_peek_op_reads_the_op_without_the_rest():
    assert p.peek_op(p.NodeStatus(node_id="n", seq=1, jobs=[]).encode()) == "node_status"
    assert p.peek_op(p.Status(rid=3).encode()) == "status"
    for junk in (b"", b"\x00", b"\x81\xa2op\x05", b"not msgpack at all"):
        assert p.peek_op(junk) is None
