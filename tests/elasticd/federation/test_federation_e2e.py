"""A federation front with real island schedulers (and a node daemon on one island) over CURVE TCP: islands
join with keys bound to their ids, report what they have, and are seen lost, back and gone."""

from __future__ import annotations

import collections
import signal

import pytest
import zmq
from cluster import Cluster
from util import cli, wait_until

from elasticd import keys, transport
from elasticd import protocol as p
from elasticd.scheduler.admission import KEY_BURST

FLOOD = 2000


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.cleanup()


def islands(front) -> dict[str, dict]:
    r = cli("islands", "--json", "--state-dir", str(front.state_dir))
    assert r.code == 0, (r.code, r.out, r.err)
    return {i["island_id"]: i for i in r.json()["islands"]}


def table_when(front, pred) -> dict[str, dict] | None:
    t = islands(front)
    return t if pred(t) else None


def test_islands_join_report_their_devices_and_are_seen_lost_back_and_gone(cluster):
    front = cluster.federation(island_timeout=1.5)
    a = cluster.island(front, "A")
    b = cluster.island(front, "B")
    cluster.node(a, "a1", cpu=3)
    seen = wait_until(lambda: table_when(front, lambda t: "B" in t and t.get("A", {})["capacity"]["devices"] == 3),
                      30, what="both islands, A with its node's devices")
    assert seen["A"]["state"] == seen["B"]["state"] == "up"
    assert seen["A"]["capacity"] | {"running": 0} == {"nodes": 1, "devices": 3, "free": 3, "running": 0, "queued": 0,
                                                      "device_types": ["cpu"], "free_speed": 3.0}
    assert seen["B"]["capacity"]["devices"] == 0
    text = cli("islands", "--state-dir", str(front.state_dir)).out
    assert "ISLAND" in text and "3/3" in text

    # A client key reads the table over CURVE; a node key may not.
    for role, code in (("client", 0), ("node", 1)):
        pub = cli("keygen", "--state-dir", str(cluster.root / role)).out.strip()
        extra = ["--node-id", "x"] if role == "node" else []
        assert cli("keygen", "--state-dir", str(front.state_dir), "--allow", pub, "--role", role, *extra).code == 0
        r = cli("islands", "--json", "--state-dir", str(cluster.root / role), "--endpoint", front.info()["tcp"],
                "--server-key", front.info()["public_key"])
        assert r.code == code, (role, r.out, r.err)
        assert ("\"A\"" in r.out) if code == 0 else ("may not send islands" in r.out), (role, r.out, r.err)

    b.kill(signal.SIGKILL)   # no bye: silent past the timeout
    lost = wait_until(lambda: table_when(front, lambda t: t["B"]["state"] == "lost"), 30, what="B lost")
    assert "no status for" in lost["B"]["reason"] and lost["A"]["state"] == "up"
    b.start()                # the same scheduler again: it says hello, and is up
    wait_until(lambda: islands(front)["B"]["state"] == "up", 30, what="B back")
    a.cleanup()              # SIGTERM: it says bye
    gone = wait_until(lambda: table_when(front, lambda t: t["A"]["state"] == "left"), 30, what="A left")
    assert "shut down" in gone["A"]["reason"]


def test_an_island_key_may_speak_only_for_its_own_island(cluster):
    front = cluster.federation()
    cluster.island(front, "B")
    intruder = cluster.island(front, "C", "B", allow_as="C")   # C's key, claiming to be B
    wait_until(lambda: "refused island_hello" in front.output(), 30, what="the front to refuse C's hello")
    assert "is bound to island 'C'; it may not speak for 'B'" in front.output()
    wait_until(lambda: "bound to island 'C'" in intruder.output(), 30, what="the scheduler to log the refusal")
    table = islands(front)
    assert set(table) == {"B"} and table["B"]["state"] == "up"


def test_a_client_flood_is_answered_busy_and_costs_no_island_its_place(cluster):
    """2000 table requests fired by one client key without waiting: every one is answered (the table or
    `busy`, KEY_RATE a second after a burst of KEY_BURST), and the island joined meanwhile stays up."""
    front = cluster.federation(island_timeout=1.5)
    cluster.island(front, "A")
    wait_until(lambda: islands(front).get("A", {}).get("state") == "up", 30, what="island A up")
    identity = keys.ensure_identity(cluster.root / "flooder")
    assert cli("keygen", "--state-dir", str(front.state_dir), "--allow", identity[0].decode()).code == 0
    ctx = zmq.Context()
    sock = transport.dealer(ctx, immediate=False)
    transport.curve_client(sock, identity, keys.parse_public_key(front.info()["public_key"]))
    sock.connect(front.info()["tcp"])
    got: collections.Counter = collections.Counter()
    try:
        for rid in range(1, FLOOD + 1):
            sock.send(p.ListIslands(rid=rid).encode())
        seen: set[int] = set()
        while len(seen) < FLOOD:
            assert sock.poll(30_000), f"{FLOOD - len(seen)} requests unanswered"
            reply = p.decode(sock.recv())
            seen.add(reply.rid)
            got[reply.code if isinstance(reply, p.Error) else type(reply).__name__] += 1
    finally:
        sock.close(linger=0)
        ctx.term()
    assert set(got) == {"IslandsReply", p.BUSY} and got["IslandsReply"] >= KEY_BURST, got
    assert islands(front)["A"]["state"] == "up"
