"""Bounds on what a user or a raw client can ask for: out-of-range numbers
are usage errors (exit 2, no traceback), string fields are capped and checked on the server whatever
sent them, requests the island can never satisfy are refused at once, and names or messages with
terminal control characters are escaped when `status` prints them."""

from __future__ import annotations

import pytest
import zmq
from cluster import Cluster, status
from util import JOBS, cli

from elasticd import protocol as p
from elasticd import transport
from elasticd.cli.status import render, render_job
from elasticd.protocol import limits as L

FAKE_SCRIPT = str(JOBS / "fake_agent.py")


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("bounds"))
    d = c.daemon(cpu=2)
    yield d
    c.cleanup()


@pytest.mark.parametrize("args, option", [
    (["--workers", str(10**30)], "--workers"),
    (["--workers", "2", "--priority", str(2**70)], "--priority"),
    (["--workers", "2", "--priority", str(-2**70)], "--priority"),
    (["--workers", "2", "--min-devices", str(2**64)], "--min-devices"),
    (["--workers", "2", "--name", "\x1b]0;owned\x07"], "--name"),
    (["--workers", "2", "--name", "n" * (L.MAX_NAME + 1)], "--name"),
    (["--workers", "2", "--env", "BIG=" + "x" * (L.MAX_ENV_BYTES + 1)], "--env"),
    (["--workers", "2", "--scale-at", "5:3"], "--scale-at"),
    (["--workers", "2", "--scale-at", "5:1,5:2"], "--scale-at"),
    (["--workers", "2", "--scale-at", "5:2:1/2"], "--scale-at"),
    (["--workers", "4", "--layout", "3,1", "--min-devices", "1"], "--layout"),
    (["--workers", "4", "--layout", "3,2"], "--layout"),
    (["--workers", "2", "--scale-at", "five:2"], "--scale-at"),
])
def test_out_of_range_submit_options_are_usage_errors(node, args, option):
    r = cli("submit", FAKE_SCRIPT, *args, "--state-dir", str(node.state_dir))
    assert r.code == 2 and option in r.err and "Traceback" not in r.err, (r.code, r.err)


def test_scale_to_a_huge_count_is_a_usage_error(node):
    r = cli("scale", "j1", "--devices", str(10**30), "--state-dir", str(node.state_dir))
    assert r.code == 2 and "--devices" in r.err and "Traceback" not in r.err


def test_min_devices_the_island_can_never_offer_is_refused_at_submit(node):
    r = cli("submit", FAKE_SCRIPT, "--workers", "8", "--min-devices", "3", "--state-dir", str(node.state_dir))
    assert r.code == 1 and "the island has 2 on 1 node(s)" in r.err and "bad_request" in r.err, r.err
    assert not [j for j in status(node.state_dir)["jobs"] if j["workers"] == 8]


def ask_raw(node, msg_dict_or_msg) -> p.Message:
    """A request sent straight to the daemon's socket, bypassing every check the CLI makes."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    s.connect(transport.ipc_endpoint(node.state_dir / "daemon.sock"))
    try:
        s.send(msg_dict_or_msg.encode())
        assert s.poll(5000), "no answer"
        return p.decode(s.recv())
    finally:
        s.close()
        ctx.term()


@pytest.mark.parametrize("fields, words", [
    ({"script": "relative/train.py"}, "absolute path"),
    ({"script": "/x\x00.py"}, "NUL"),
    ({"script": "/" + "a" * 100_000}, "longer than 4096"),
    ({"cwd": "tmp"}, "absolute path"),
    ({"name": "\x1b[2J"}, "control characters"),
    ({"env": {f"K{i}": "v" for i in range(L.MAX_ENV_ITEMS + 1)}}, "at most 256"),
    ({"env": {"K": "x" * 900_000}}, "bytes, at most"),
    ({"workers": 2**40}, "workers must be in"),
    ({"priority": 2**62}, "priority must be in"),
])
def test_a_raw_client_gets_typed_errors_for_unbounded_fields(node, fields, words):
    body = {"script": FAKE_SCRIPT, "workers": 1, **fields}
    reply = ask_raw(node, p.Submit(**body))
    assert isinstance(reply, p.Error) and reply.code == p.BAD_REQUEST and words in reply.message, reply
    assert status(node.state_dir)["nodes"][0]["alive"]   # and it keeps serving


def test_status_escapes_control_characters():
    evil = "\x1b]0;owned\x07\x1b[2J\x9b31m"
    info = p.JobInfo(job_id="j1", name=evil, state="failed", workers=1, devices=1, min_devices=1, max_devices=1,
                     priority=0, nodes=[evil], script="/s.py" + evil, history=[[0.0, "failed", evil]],
                     error={"message": evil, "traceback": f"Traceback\n  line {evil}\n"})
    node = p.NodeInfo(node_id=evil, host=evil, alive=True, devices=[], free=[], last_seen_s=0.0)
    for text in (render(p.StatusReply(jobs=[info], nodes=[node])), render_job(info)):
        assert not any(ord(c) < 32 and c != "\n" or 0x7f <= ord(c) <= 0x9f for c in text), repr(text)
        assert "\\x1b]0;owned\\x07" in text
    assert "line \\x1b" in render_job(info)   # tracebacks keep their lines, lose their escapes


def test_submit_wait_shows_a_finished_job_s_progress_whole():
    from elasticd.cli.submit import _progress

    def info(state: str, step: int) -> p.JobInfo:
        return p.JobInfo(job_id="j1", name="", state=state, workers=2, devices=1, min_devices=1, max_devices=2,
                         priority=0, nodes=["a"], step=step, metrics={"total_steps": 5})

    assert "[###################.....] 4/5" in _progress(info("running", 4))   # the last step under way
    assert "[########################] 5/5" in _progress(info("finished", 4))
