"""The federation front's island table and its rules of who may say what, driven by hand (no sockets)."""

from __future__ import annotations

import pytest

from elasticd import keys
from elasticd import protocol as p
from elasticd.federation import authz
from elasticd.federation.state import FederationState
from elasticd.scheduler import authz as scheduler_authz
from elasticd.scheduler.authz import LOCAL, Principal


def cap(free: int, devices: int = 4) -> p.IslandCapacity:
    return p.IslandCapacity(nodes=1, devices=devices, free=free, device_types=["cpu"])


def test_an_island_is_up_from_its_hello_lost_when_silent_and_up_again_when_it_says_hello():
    fed = FederationState(timeout_s=5.0)
    assert fed.hello(p.IslandHello(island_id="A", capacity=cap(4)), 100.0).known
    assert fed.status(p.IslandStatus(island_id="A", seq=1, capacity=cap(1)), 103.0).known
    (a,) = fed.table().islands
    assert (a.state, a.capacity.free, a.last_seen) == ("up", 1, 103.0)
    assert fed.tick(107.0) == []            # 4 s of silence: within the timeout
    assert fed.tick(108.5) == ["A"]
    (a,) = fed.table().islands
    assert a.state == "lost" and "no status for 6s" in a.reason
    # its next status is not taken: the scheduler is told to say hello again
    assert not fed.status(p.IslandStatus(island_id="A", seq=2, capacity=cap(2)), 109.0).known
    assert fed.table().islands[0].state == "lost"
    fed.hello(p.IslandHello(island_id="A", capacity=cap(3)), 110.0)
    (a,) = fed.table().islands
    assert (a.state, a.reason, a.capacity.free, a.joined_at) == ("up", "", 3, 110.0)


def test_a_status_from_an_island_never_seen_asks_for_a_hello_and_a_bye_marks_it_left():
    fed = FederationState()
    assert not fed.status(p.IslandStatus(island_id="B", seq=9, capacity=cap(1)), 1.0).known   # a restarted front
    assert fed.table().islands == []
    fed.hello(p.IslandHello(island_id="B", capacity=cap(1)), 2.0)
    fed.bye(p.IslandBye(island_id="B"), 3.0)
    (b,) = fed.table().islands
    assert b.state == "left" and fed.tick(1000.0) == []   # gone on purpose: never "lost"


def test_capacity_a_peer_could_not_have_is_refused_on_the_wire():
    for bad in (p.IslandCapacity(devices=2, free=3), p.IslandCapacity(nodes=-1),
                p.IslandCapacity(device_types=["\x1b[2J"])):
        with pytest.raises(p.ProtocolError):
            p.decode(p.IslandHello(island_id="A", capacity=bad).encode())
    with pytest.raises(p.ProtocolError):
        p.decode(p.IslandStatus(island_id="a b", capacity=cap(1)).encode())


ISLAND_A = Principal(owner="k1", role=keys.ISLAND, name="a", node_id="A")
CLIENT = Principal(owner="k2", role=keys.CLIENT, name="c")
NODE = Principal(owner="k3", role=keys.NODE, name="n", node_id="A")
ADMIN = Principal(owner="k4", role=keys.ADMIN, name="root")


@pytest.mark.parametrize(("who", "msg", "allowed"), [
    (ISLAND_A, p.IslandHello(island_id="A"), True),
    (ISLAND_A, p.IslandStatus(island_id="A"), True),
    (ISLAND_A, p.IslandBye(island_id="A"), True),
    (ISLAND_A, p.IslandHello(island_id="B"), False),   # bound to its own island
    (ISLAND_A, p.IslandBye(island_id="B"), False),
    (CLIENT, p.IslandHello(island_id="A"), False),
    (NODE, p.IslandStatus(island_id="A"), False),      # a node key bound to "A" is no island key
    (ADMIN, p.IslandHello(island_id="A"), False),      # only an island speaks for an island
    (LOCAL, p.IslandHello(island_id="A"), True),
    (CLIENT, p.ListIslands(), True),
    (ISLAND_A, p.ListIslands(), True),
    (NODE, p.ListIslands(), False),
    (CLIENT, p.Status(), False),                       # a front serves no scheduler request
])
def test_who_may_tell_the_front_what(who, msg, allowed):
    why = authz.check(who, msg)
    assert (why is None) == allowed, why


def test_an_island_key_on_a_schedulers_allow_list_may_do_nothing_there():
    for msg in (p.Status(), p.Submit(script="/s.py", workers=2), p.NodeHello(node_id="A", host="h", devices=[])):
        assert "island key" in scheduler_authz.check(ISLAND_A, msg)


def test_island_keys_are_bound_to_one_island_id(tmp_path):
    pub = keys.ensure_identity(tmp_path / "isl")[0]
    keys.allow_key(tmp_path, pub, "isl", role=keys.ISLAND, node_id="A")
    (grant,) = keys.allowed_grants(tmp_path).values()
    assert (grant.role, grant.node_id) == (keys.ISLAND, "A")
    assert 'island-id = "A"' in (keys.allowed_dir(tmp_path) / "isl.key").read_text()
    with pytest.raises(keys.BadKeyError, match="--island-id"):
        keys.allow_key(tmp_path, pub, "isl2", role=keys.ISLAND)
    with pytest.raises(keys.BadKeyError):
        keys.allow_key(tmp_path, pub, "isl3", role=keys.CLIENT, node_id="A")
