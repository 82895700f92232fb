"""The wire format: every message round-trips; nothing but `ProtocolError` comes out of bad input."""

from __future__ import annotations

import dataclasses
import random
import subprocess
import sys
import time
import typing

import msgpack
import pytest
import zmq

from elasticd import protocol as p
from elasticd.agent.control.zmq_channel import ZmqControl
from elasticd.core.records import Recovery, ResizeEntry


def sample(tp, rng: random.Random):
    origin = typing.get_origin(tp)
    if tp is str:
        return f"s{rng.randrange(100)}"
    if tp is int:
        return rng.randrange(-5, 100)
    if tp is float:
        return rng.random()
    if tp is bool:
        return rng.random() < 0.5
    if tp is typing.Any:
        return {"k": 1}
    if origin in (typing.Union, __import__("types").UnionType):
        return sample(typing.get_args(tp)[0], rng)
    if origin is list:
        return [sample(typing.get_args(tp)[0], rng) for _ in range(2)]
    if origin is tuple:
        return tuple(sample(a, rng) for a in typing.get_args(tp))
    if origin is dict:
        kt, vt = typing.get_args(tp)
        return {sample(kt, rng): sample(vt, rng)}
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: sample(hints[f.name], rng) for f in dataclasses.fields(tp)})
    raise TypeError(tp)


_IN_BOUNDS = {"submit": {"script": "/s.py", "cwd": "/w", "workers": 8, "min_devices": 1, "max_devices": 4,
                         "scale_at": [p.ScaleAt(step=10, devices=2, blocks=[3, 5]), p.ScaleAt(step=30, devices=8)],
                         "threads": 2, "device_memory": 1 << 30, "blocks": [6, 2]},
              "scale_job": {"devices": 2},
              # a layout's blocks must describe `devices` agents hosting `workers` (protocol.nodes.bad_blocks)
              "launch_job": {"workers": 8, "devices": 2, "blocks": [6, 2], "stuck_after": "90s", "hold_at": [4, 9],
                             "threads": 3, "device_memory": 5, "snapshot_key": "0af3"},
              "prepare_resize": {"workers": 8, "devices": 2, "blocks": [5, 3], "stuck_after": "off", "hold_at": [9],
                                 "threads": 0, "device_memory": 7, "snapshot_key": "77aa"},
              "resize_job": {"devices": 3, "blocks": [7, 1, 2], "islands": [1, 2]},
              "island_hello": {"island_id": "A", "capacity": p.IslandCapacity(nodes=1, devices=4, free=2)},
              "island_status": {"island_id": "b-2", "capacity": p.IslandCapacity(devices=3, free=3, running=1,
                                                                                 device_types=["cuda"])},
              "island_bye": {"island_id": "A"},
              "reserve_portion": {"script": "/s.py", "threads": 1, "portion": p.PortionSpec(
                  span_id="s3", attempt=2, index=1, workers=8, world=3, rank_offset=2, blocks=[3, 3, 2],
                  islands=[2, 1], key="9c0e", restore=True)},
              "submit_spanning": {"script": "/s.py", "workers": 8, "devices": 4, "islands": ["A", "B"],
                                  "max_islands": 2, "threads": 1, "max_restarts": 2},
              "start_portion": {"span_id": "s3", "master_port": 4242},
              "move_portion": {"span_id": "s3", "epoch": 3, "devices_from": 4, "world": 3, "blocks": [3, 3, 2],
                               "islands": [2, 1], "keep": [0, 1, 3], "index": 1},
              "go_portion": {"span_id": "s3", "master_addr": "h", "master_port": 4243},
              "abort_portion_move": {"span_id": "s3"},
              "cancel_portion": {"span_id": "s3"},
              "islands_reply": {"islands": [p.IslandInfo(island_id="A", state="up", capacity=p.IslandCapacity(),
                                                         joined_at=1.0, last_seen=2.0)]}}


@pytest.mark.parametrize("op", sorted(p.registered_ops()))
def test_every_message_round_trips(op):
    cls = p.registered_ops()[op]
    msg = sample(cls, random.Random(op))
    for name, value in _IN_BOUNDS.get(op, {}).items():   # values Message.check() would refuse
        setattr(msg, name, value)
    back = p.decode(msg.encode())
    assert type(back) is cls and back == msg
    assert msg.to_wire()["v"] == p.PROTOCOL_VERSION and msg.to_wire()["op"] == op


def test_ops_are_unique_and_named():
    ops = p.registered_ops()
    assert len({cls for cls in ops.values()}) == len(ops)
    assert all(cls.op == op for op, cls in ops.items())


@pytest.mark.parametrize("frame,code", [
    (b"", p.BAD_FRAME),
    (b"\xc1", p.BAD_FRAME),
    (msgpack.packb([1, 2]), p.BAD_FRAME),
    (msgpack.packb({"op": "status"}), p.VERSION_MISMATCH),
    (msgpack.packb({"v": p.PROTOCOL_VERSION + 1, "op": "status"}), p.VERSION_MISMATCH),
    (msgpack.packb({"v": p.PROTOCOL_VERSION, "op": "launch_missiles"}), p.UNKNOWN_OP),
    (msgpack.packb({"v": p.PROTOCOL_VERSION}), p.UNKNOWN_OP),
    (msgpack.packb({"v": p.PROTOCOL_VERSION, "op": "submit", "script": "/x"}), p.BAD_REQUEST),
    (msgpack.packb({"v": p.PROTOCOL_VERSION, "op": "submit", "script": "/x", "workers": True}), p.BAD_REQUEST),
    (msgpack.packb({"v": p.PROTOCOL_VERSION, "op": "submit", "script": "/x", "workers": 2, "env": {"A": 1}}), p.BAD_REQUEST),
    (msgpack.packb({"v": p.PROTOCOL_VERSION, "op": "submit", "script": "/x", "workers": 2,
                    "scale_at": [{"step": 5, "devices": 3}]}), p.BAD_REQUEST),   # more devices than workers
    (msgpack.packb({"v": p.PROTOCOL_VERSION, "op": "submit", "script": "/x", "workers": 2,
                    "scale_at": [{"step": 5, "devices": 1}, {"step": 2, "devices": 2}]}), p.BAD_REQUEST),
    (msgpack.packb({"v": p.PROTOCOL_VERSION, "op": "submit", "script": "/x", "workers": 2,
                    "scale_at": [[5, 1]]}), p.BAD_REQUEST),   # an entry is a record, not a pair
    (msgpack.packb({"v": p.PROTOCOL_VERSION, "op": "submit", "script": "/x", "workers": 2, "threads": -1}),
     p.BAD_REQUEST),
    (msgpack.packb({"v": p.PROTOCOL_VERSION, "op": "submit", "script": "/x", "workers": 4,
                    "scale_at": [{"step": 5, "devices": 2, "blocks": [1, 2]}]}), p.BAD_REQUEST),   # not 4 workers
    (msgpack.packb({"v": p.PROTOCOL_VERSION, "op": "status", "job_id": None, "admin": True}), p.BAD_REQUEST),
    (msgpack.packb({"v": p.PROTOCOL_VERSION, "op": "node_status", "node_id": "n", "jobs": [{"job_id": "j"}]}), p.BAD_REQUEST),
    (b"\x00" * (p.MAX_FRAME_BYTES + 1), p.TOO_LARGE),
])
def test_bad_frames_raise_typed_errors(frame, code):
    with pytest.raises(p.ProtocolError) as e:
        p.decode(frame)
    assert e.value.code == code
    assert p.error_from(e.value, 3) == p.Error(code=code, message=e.value.message, rid=3)


def test_random_bytes_only_ever_raise_protocol_error():
    rng = random.Random(0)
    good = p.Submit(script="/x.py", workers=4, env={"A": "b"}).encode()
    for i in range(5000):
        if i % 2:
            frame = rng.randbytes(rng.randrange(64))
        else:
            b = bytearray(good)
            for _ in range(rng.randrange(1, 5)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            frame = bytes(b)
        try:
            p.decode(frame)
        except p.ProtocolError:
            pass


def test_ints_widen_to_float_but_bools_are_not_ints():
    m = p.decode(msgpack.packb({"v": p.PROTOCOL_VERSION, "op": "welcome", "node_id": "n", "heartbeat_s": 1}))
    assert m.heartbeat_s == 1.0 and isinstance(m.heartbeat_s, float)
    with pytest.raises(p.ProtocolError):
        p.decode(msgpack.packb({"v": p.PROTOCOL_VERSION, "op": "scale_job", "job_id": "j", "devices": False}))


def test_peek_rid_survives_garbage():
    assert p.peek_rid(msgpack.packb({"rid": 9, "v": 5})) == 9
    for junk in (b"", b"\xc1", msgpack.packb({"rid": "x"}), msgpack.packb({"rid": -1}), msgpack.packb([1])):
        assert p.peek_rid(junk) == 0


def test_flat_scalars_bounds_peer_dicts():
    nested = {"loss": 0.5, "step": 3, "ok": True, "name": "x" * 100000, "deep": {"a": [1]}, 7: 1, "n": None}
    out = p.flat_scalars(nested)
    assert out == {"loss": 0.5, "step": 3, "ok": True, "name": "x" * 65536, "n": None}
    assert len(p.flat_scalars({str(i): i for i in range(1000)})) == 64
    assert p.flat_scalars([1]) == {}


def test_zmq_control_never_blocks_without_a_daemon(tmp_path):
    ctl = ZmqControl(f"ipc://{tmp_path}/nobody.sock", "j1", 0, step_every_s=0.0)
    start = time.monotonic()
    ctl.hello(p.AgentInfo(world=1, hosted=[0], pid=1, host="h", device="cpu"))
    for i in range(5000):
        ctl.step(i, {"loss": 1.0})
    assert ctl.poll() == []
    ctl.done(stopped=False)
    ctl.close()
    assert time.monotonic() - start < 5.0
    assert ctl.dropped > 0


def test_zmq_control_messages_coalescing_and_commands(tmp_path):
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{tmp_path}/d.sock")
    ctl = ZmqControl(f"ipc://{tmp_path}/d.sock", "j1", 3, step_every_s=60.0)
    info = p.AgentInfo(world=4, hosted=[3], pid=42, host="h", device="cpu")
    ctl.hello(info)
    for i in range(1, 1001):
        ctl.step(i, {"loss": 1.0 / i, "nested": {"dropped": 1}})  # type: ignore[dict-item]  # what a user may log
    ctl.done(stopped=False)
    got = []
    while len(got) < 4:
        assert router.poll(5000)
        ident, frame = router.recv_multipart()
        got.append(p.decode(frame))
    assert [type(m) for m in got] == [p.AgentHello, p.AgentStep, p.AgentStep, p.AgentDone]
    assert got[0].info == info and got[0].rank == 3 and got[0].job_id == "j1"
    assert got[2].metrics == {"loss": 1.0 / 1000}       # bounded to scalars, as a daemon stores them
    assert got[1].step == 1 and got[2].step == 1000     # first sent, the rest coalesced, last flushed
    assert not router.poll(100)
    router.send_multipart([ident, p.AgentStop().encode()])
    router.send_multipart([ident, p.AgentResize(epoch=1, world=2, master_addr="h", master_port=5).encode()])
    router.send_multipart([ident, b"garbage"])
    cmds: list = []
    deadline = time.monotonic() + 5
    while len(cmds) < 2 and time.monotonic() < deadline:
        cmds += ctl.poll()
    assert cmds == [p.AgentStop(), p.AgentResize(epoch=1, world=2, master_addr="h", master_port=5)]
    ctl.resized(p.ResizedInfo(epoch=1, world=2, rank=1, left=False, seconds=0.5, blocks="2,2"))
    assert router.poll(5000)
    resized = p.decode(router.recv_multipart()[1])
    assert isinstance(resized, p.AgentResized) and resized.info.seconds == 0.5 and resized.rank == 3
    ctl.close()
    router.close(linger=0)
    ctx.term()


def test_a_refusal_sent_again_with_its_epoch_is_told_the_job_s_log_once(tmp_path, capfd):
    """Rank 0 says a refusal in the job's log. Refused before its copy of the command came (another agent's
    command made the vote), it sends the same refusal again with the command's epoch once the copy comes:
    both reach the node, the log says it once."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.bind(f"ipc://{tmp_path}/d.sock")
    ctl = ZmqControl(f"ipc://{tmp_path}/d.sock", "j1", 0)
    first = p.RefusedInfo(epoch=None, step=5, message="cannot carry `x`", by=0)
    for info in (first, dataclasses.replace(first, epoch=3), p.RefusedInfo(epoch=4, step=9, message="cannot carry `x`",
                                                                           by=0)):
        ctl.refused(info)
    got = []
    while len(got) < 3:
        assert router.poll(5000)
        got.append(p.decode(router.recv_multipart()[1]))
    assert [(m.info.epoch, m.info.step) for m in got] == [(None, 5), (3, 5), (4, 9)]
    err = capfd.readouterr().err
    assert err.count("resize after step 5 refused") == 1 and err.count("resize after step 9 refused") == 1, err
    ctl.close()
    router.close(linger=0)
    ctx.term()


ROGUE_JOB = '''
import time

import msgpack
import torch

import elasticd


@elasticd.elastic(workers=1)
def train(ctx):
    # A buggy agent: one well-formed frame whose op no supervisor knows, on its own connection to it.
    control = ctx._rt.control
    with control._lock:
        control._sock.send(msgpack.packb({"v": VERSION, "op": "launch_missiles"}))
    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ctx.replicate(model, opt)
    for _ in ctx.steps(6000):   # a minute: only its supervisor ends it
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        time.sleep(0.01)
'''.replace("VERSION", str(p.PROTOCOL_VERSION))


def test_elasticd_run_ends_a_run_whose_agent_sends_what_is_no_event(tmp_path):
    """Strict on the node's side: a frame it cannot read from its own agent fails the run instead of being skipped."""
    (tmp_path / "rogue.py").write_text(ROGUE_JOB)
    out = subprocess.run([sys.executable, "-m", "elasticd", "run", "rogue.py", "--devices", "1"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "unreadable message from agent 0: unknown op 'launch_missiles'" in out.stderr, out.stderr[-3000:]


def test_agent_reports_are_typed_records_decoded_strictly():
    """An agent's report is a record with named fields; a field of the wrong type or a missing one is refused
    by name, not stored for the daemon to trip over later."""
    ok = p.AgentFailed(job_id="j", rank=1, error=p.AgentError(message="ValueError: x", logical_rank=3))
    assert p.decode(ok.encode()) == ok
    body = ok.to_wire()
    body["error"] = {**body["error"], "logical_rank": "three"}
    with pytest.raises(p.ProtocolError, match=r"error\.logical_rank"):
        p.decode(msgpack.packb(body))
    body = p.AgentHello(job_id="j", rank=0, info=p.AgentInfo(world=1, hosted=[0], pid=1, host="h",
                                                                device="cpu")).to_wire()
    del body["info"]["pid"]
    with pytest.raises(p.ProtocolError, match="missing field 'pid'"):
        p.decode(msgpack.packb(body))
    # No agent message carries an untyped map any more: what is not a record is a map of scalars.
    for cls in p.EVENTS + p.COMMANDS:
        for f in dataclasses.fields(cls):
            assert "Any" not in str(f.type), (cls.__name__, f.name, f.type)


def _untyped_fields() -> set[str]:
    """Fields of every message, and of the records nested in them, whose annotation admits `Any`."""
    seen: set[type] = set()
    out: set[str] = set()

    def walk(cls: type) -> None:
        if cls in seen:
            return
        seen.add(cls)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            if "Any" in str(tp):
                out.add(f"{cls.__name__}.{f.name}")
            inner = [tp, *typing.get_args(tp), *(x for a in typing.get_args(tp) for x in typing.get_args(a))]
            for a in inner:
                if dataclasses.is_dataclass(a):
                    walk(a)

    for cls in p.registered_ops().values():
        walk(cls)
    return out


def test_no_message_field_is_an_untyped_map():
    # Every payload, down to the rows `status` and `events` print, is a typed record or a map of scalars,
    # checked at decoding. A new untyped field fails here.
    assert _untyped_fields() == set()


def test_a_status_row_travels_typed_with_a_resize_s_from_and_to_under_those_names():
    job = p.JobInfo(
        job_id="j1", name="", state="resizing", workers=8, devices=2, min_devices=1, max_devices=4, priority=0,
        nodes=["n1"], resizes=[ResizeEntry(src=4, dst=2, outcome="done", at=1.0, why="scale command", step=7)],
        resizing=p.ResizeInFlight(epoch=2, src=2, dst=1, why="policy", phase="prepare", at=2.0, saved=3, parts=9),
        history=[(0.5, "queued", "submitted")],
        agents=[p.AgentRow(rank=0, node="n1", device="cpu:0", pid=7, alive=True, rss=1, cpu=0.5,
                           timing={"hosted": 4, "compute_s": 0.1})],
        recoveries=[Recovery(cause="agent killed", at=1.5, failed_after_step=3, from_devices=2, devices=2)],
        snapshot={"step": 6, "bytes": 1024},
        layout=p.JobLayout(agents=[p.LayoutAgent(rank=0, device="n1/0", workers=4, speed=1.0, worker_step_s=None)],
                           predicted_step_s=0.2, measured_step_s=None, comm_s=0.01))
    node = p.NodeInfo(node_id="n1", host="h", alive=True, devices=["cpu:0"], free=[], last_seen_s=0.1,
                      draining=p.DrainInfo(since=1.0, deadline_s=None, drained=False, seconds=0.5))
    reply = p.StatusReply(jobs=[job], nodes=[node])
    assert p.decode(reply.encode()) == reply
    body = reply.to_wire()
    row = body["jobs"][0]
    assert (row["resizes"][0]["from"], row["resizes"][0]["to"]) == (4, 2) and "src" not in row["resizes"][0]
    assert (row["resizing"]["from"], row["resizing"]["to"]) == (2, 1) and row["history"] == [[0.5, "queued", "submitted"]]
    # Decoded strictly: a history row of the wrong length, a resize without its "to", an agent's pid as text.
    for path, bad in ((("history", 0), [0.5, "queued"]), (("resizes", 0, "to"), None), (("agents", 0, "pid"), "7")):
        doc = reply.to_wire()
        where = doc["jobs"][0]
        for k in path[:-1]:
            where = where[k]
        if bad is None:
            del where[path[-1]]
        else:
            where[path[-1]] = bad
        with pytest.raises(p.ProtocolError, match=path[0]):
            p.decode(msgpack.packb(doc))
    events = p.EventsReply(events=[p.Event(at=1.0, event="resized", detail="4 -> 2", job="j1", src=4, dst=2)])
    assert p.decode(events.encode()) == events and events.to_wire()["events"][0]["from"] == 4


def test_a_heartbeat_with_a_non_scalar_metric_is_refused_by_name():
    report = p.JobReport(job_id="j", state="running", ranks=[0], metrics={"loss": 1.0, "n": 2, "ok": True},
                         error={"message": "m", "rank": 1, "logical_rank": None})
    status = p.NodeStatus(node_id="n", jobs=[report])
    assert p.decode(status.encode()) == status
    body = status.to_wire()
    body["jobs"][0]["metrics"] = {"loss": [1.0, 2.0]}
    with pytest.raises(p.ProtocolError, match=r"jobs\.metrics"):
        p.decode(msgpack.packb(body))
