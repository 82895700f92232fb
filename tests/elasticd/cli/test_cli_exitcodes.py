"""Exit codes are a contract: 0 ok, 1 the daemon answered with an error, 2 usage, 3 unreachable;
`--json` prints one JSON document and never exits 0 on an error reply."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
from cluster import Cluster
from util import JOBS
from util import cli_process as cli  # the CLI as a shell runs it: an interpreter of its own

FAKE_SCRIPT = str(JOBS / "fake_agent.py")


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    c = Cluster(tmp_path_factory.mktemp("codes"))
    d = c.daemon(cpu=1)
    yield d
    c.cleanup()


def test_no_daemon_is_exit_3_fast_with_a_clear_message(tmp_path):
    start = time.monotonic()
    r = cli("status", "--state-dir", str(tmp_path))
    assert r.code == 3 and "no elasticd daemon is running" in r.err and "elasticd start" in r.err
    assert time.monotonic() - start < 10
    r = cli("status", "--json", "--state-dir", str(tmp_path))
    assert r.code == 3 and r.json()["op"] == "error" and r.json()["code"] == "unreachable"


def test_stale_socket_of_a_dead_daemon_is_exit_3(tmp_path):
    (tmp_path / "daemon.sock").touch()
    (tmp_path / "daemon.json").write_text(json.dumps({"pid": 2**22 + 12345}))
    r = cli("stop", "j1", "--state-dir", str(tmp_path))
    assert r.code == 3 and "not running" in r.err


def test_env_var_selects_the_state_dir(node):
    r = cli("status", env={"ELASTICD_STATE_DIR": str(node.state_dir)})
    assert r.code == 0 and "NODE" in r.out


@pytest.mark.parametrize("args,code", [
    (["status", "j999"], "unknown_job"),
    (["stop", "j999"], "unknown_job"),
    (["scale", "j999", "--devices", "1"], "unknown_job"),
])
def test_error_replies_are_exit_1_also_with_json(node, args, code):
    r = cli(*args, "--state-dir", str(node.state_dir))
    assert r.code == 1 and code in r.err and r.out == ""
    r = cli(*args, "--json", "--state-dir", str(node.state_dir))
    assert r.code == 1
    doc = r.json()
    assert doc["op"] == "error" and doc["code"] == code and doc["message"]


def test_scale_out_of_range_is_exit_1_or_2(node):
    sd = str(node.state_dir)
    hung = cli("submit", FAKE_SCRIPT, "--workers", "1", "--env", "FAKE_MODE=hang", "--state-dir", sd).out.strip()
    job = cli("submit", FAKE_SCRIPT, "--workers", "2", "--state-dir", sd).out.strip()   # queued behind it
    r = cli("scale", job, "--devices", str(10**30), "--state-dir", sd)   # cannot even be sent
    assert r.code == 2 and "--devices" in r.err and "Traceback" not in r.err, r.err
    # outside 1..N; beyond what the island can offer
    for m, why in (("0", "1..2"), ("-1", "1..2"), ("3", "1..2"), ("2", "the island has 1")):
        r = cli("scale", job, "--devices", m, "--state-dir", sd)
        assert r.code == 1 and "bad_request" in r.err and why in r.err, (m, r.err)
    for j in (job, hung):
        assert cli("stop", j, "--state-dir", sd).code == 0


@pytest.mark.parametrize("args", [
    ["submit", "/no/such/script.py", "--workers", "2"],
    ["submit", FAKE_SCRIPT, "--workers", "2", "--min-devices", "3"],
    ["submit", FAKE_SCRIPT, "--workers", "2", "--env", "1BAD=x"],
    ["submit", FAKE_SCRIPT, "--workers", "0"],
    ["submit", FAKE_SCRIPT, "--workers", "2", "--stuck-after", "soon"],
    ["status", "--bogus"],
    ["scale", "j1"],
    ["status", "--endpoint", "tcp://127.0.0.1:1"],       # tcp needs --server-key
    ["status", "--endpoint", "foo"],                      # neither tcp:// nor ipc://
])
def test_usage_errors_are_exit_2(node, args):
    r = cli(*args, "--state-dir", str(node.state_dir))
    assert r.code == 2, (r.code, r.err)


def test_a_daemon_that_does_not_answer_is_exit_3_after_the_timeout(node):
    os.kill(node.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        r = cli("status", "--timeout", "1", "--state-dir", str(node.state_dir))
        assert r.code == 3 and "no answer" in r.err
        assert time.monotonic() - start < 10
    finally:
        os.kill(node.pid, signal.SIGCONT)
    assert cli("status", "--state-dir", str(node.state_dir)).code == 0


def test_second_daemon_on_the_same_state_dir_is_refused(node):
    r = cli("start", "--state-dir", str(node.state_dir), "--cpu-devices", "1", "--bind", "none", timeout=30)
    assert r.code == 1 and "in use" in r.err
    assert cli("status", "--state-dir", str(node.state_dir)).code == 0


def test_keygen_prints_a_stable_public_key_and_rejects_bad_keys(tmp_path):
    a = cli("keygen", "--state-dir", str(tmp_path))
    b = cli("keygen", "--state-dir", str(tmp_path), "--json")
    assert a.code == 0 and len(a.out.strip()) == 40 and b.json()["public_key"] == a.out.strip()
    assert cli("keygen", "--state-dir", str(tmp_path), "--force").out.strip() != a.out.strip()
    assert cli("keygen", "--state-dir", str(tmp_path), "--allow", "not-a-key").code == 2
    assert (tmp_path / "keys" / "id.key_secret").stat().st_mode & 0o077 == 0


def test_daemon_on_a_taken_port_fails_fast_with_a_hint(node, tmp_path):
    r = cli("start", "--state-dir", str(tmp_path / "other"), "--cpu-devices", "1", "--bind", node.info()["scheduler_tcp"],
            timeout=60)
    assert r.code == 1 and "cannot bind" in r.err and "--bind" in r.err
    assert not (tmp_path / "other" / "daemon.sock").exists()
