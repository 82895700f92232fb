"""Metrics, status page and its JSON over HTTP, against a real daemon with its embedded scheduler
and fake agents: what Prometheus scrapes, what the page polls, what a bad request gets, and, with Debian's
`chromium` installed, what a person sees in a real headless browser.
"""

from __future__ import annotations

import http.client
import json
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
from cluster import wait_state
from scrape import get, samples, value
from util import JOBS, cli, wait_until

FAKE_SCRIPT = str(JOBS / "fake_agent.py")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture
def island(cluster):
    """A daemon serving metrics on a free loopback port, running a 2-worker job resized 2 -> 1."""
    d = cluster.daemon("node", "--metrics", "127.0.0.1:0", cpu=2)
    url = d.info()["metrics"]
    assert url.startswith("http://127.0.0.1:"), url
    sd = str(d.state_dir)
    r = cli("submit", FAKE_SCRIPT, "--workers", "2", "--name", "demo", "--env", "FAKE_MODE=hang",
            "--env", "FAKE_STEP_S=0.05", "--state-dir", sd)
    assert r.code == 0, r.err
    job = r.out.strip()
    wait_state(d.state_dir, job, "running")
    return d, url, job


def scale_to_1(d, job: str) -> None:
    assert cli("scale", job, "--devices", "1", "--state-dir", str(d.state_dir)).code == 0
    wait_until(lambda: any(r["outcome"] == "done" for r in _job(d, job)["resizes"]), 30, what="the resize")


def _job(d, job: str) -> dict:
    r = cli("status", job, "--json", "--state-dir", str(d.state_dir))
    assert r.code == 0, r.err
    return r.json()["jobs"][0]


def test_prometheus_sees_jobs_nodes_resizes_and_the_scheduler(island):
    d, url, job = island
    scale_to_1(d, job)
    node = d.info()["node_id"]

    def scraped() -> dict | None:
        # the device the resize gave up is free once the node has seen its agent exit: a heartbeat later
        m = samples(url)
        done = value(m, "elasticd_resize_duration_seconds_count", outcome="done") == 1.0
        return m if done and value(m, "elasticd_node_devices", node=node, state="free") == 1.0 else None
    m = wait_until(scraped, 30, interval=0.2, what="the resize to show in the metrics")
    lab = {"job": job, "name": "demo"}
    assert value(m, "elasticd_jobs", state="running") == 1.0 and value(m, "elasticd_jobs", state="failed") == 0.0
    assert value(m, "elasticd_job_workers", **lab) == 2.0
    assert value(m, "elasticd_job_devices", **lab) == 1.0
    assert value(m, "elasticd_job_devices_max", **lab) == 2.0
    assert value(m, "elasticd_job_step", **lab) > 0
    assert value(m, "elasticd_job_steps_per_second", **lab) is not None
    assert 0 < value(m, "elasticd_job_logged_value", metric="loss", **lab) <= 1.0
    assert value(m, "elasticd_job_resizes_total", outcome="done", **lab) == 1.0
    assert value(m, "elasticd_node_devices", node=node, state="busy") == 1.0
    assert value(m, "elasticd_node_devices", node=node, state="free") == 1.0
    assert value(m, "elasticd_node_up", node=node) == 1.0
    assert value(m, "elasticd_node_draining", node=node) == 0.0
    assert value(m, "elasticd_nodes", state="alive") == 1.0 and value(m, "elasticd_nodes", state="lost") == 0.0
    assert value(m, "elasticd_device_speed", node=node, device="cpu:0") is not None
    assert value(m, "elasticd_scheduler_heartbeats_total") > 0
    assert value(m, "elasticd_scheduler_request_duration_seconds_count", op="status") > 0
    assert value(m, "elasticd_scheduler_request_duration_seconds_count", op="scale_job") == 1.0


def test_the_json_the_page_polls_grows_and_bad_requests_get_4xx_while_serving_goes_on(island):
    d, url, job = island
    host, port = url.removeprefix("http://").rsplit(":", 1)

    def points() -> int:
        code, text = get(url + "/api/status.json")
        assert code == 200
        return len(json.loads(text)["series"].get(job, []))
    first = wait_until(points, 20, interval=0.2, what="a first sample of the job")
    wait_until(lambda: points() > first, 20, interval=0.2, what="the job's series to grow")
    doc = json.loads(get(url + "/api/status.json")[1])
    (row,) = [j for j in doc["jobs"] if j["job"] == job]
    assert row["state"] == "running" and row["workers"] == 2 and row["devices"] == 2 and row["name"] == "demo"
    assert doc["nodes"][0]["devices"] == 2 and doc["alloc"]

    code, page = get(url + "/")
    assert code == 200 and "<title>elasticd</title>" in page and "api/status.json" in page
    assert get(url + "/nope")[0] == 404
    for method in ("POST", "PUT", "DELETE", "BREW"):
        c = http.client.HTTPConnection(host, int(port), timeout=10)
        c.request(method, "/metrics", body=b"x")
        assert c.getresponse().status == 405, method
        c.close()
    for raw in (b"GET / HTTP/1.1 extra words\r\n\r\n", b"GET /" + b"a" * 70000 + b" HTTP/1.1\r\n\r\n",
                b"GET / HTTP/1.1\r\n" + b"X: " + b"y" * 70000 + b"\r\n\r\n"):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(raw)
            answer = s.recv(64)
        assert answer.startswith(b"HTTP/1.") and answer[9:10] == b"4", (raw[:20], answer)
    with socket.create_connection((host, int(port)), timeout=10):
        pass   # a connection that says nothing and goes
    # A request line of two words (HTTP/0.9) is answered at once, not after the 10 s read timeout.
    with socket.create_connection((host, int(port)), timeout=3) as s:
        s.sendall(b"GET /\r\n")
        assert s.recv(64).startswith(b"HTTP/1.0 400")
    # DNS rebinding: a page of another site reaching this port by a name of its own gets nothing.
    for name, want in (("evil.example", 421), (f"evil.example:{port}", 421), (f"127.0.0.1:{port}", 200),
                       (f"localhost:{port}", 200), (socket.gethostname(), 200)):
        c = http.client.HTTPConnection(host, int(port), timeout=10)
        c.request("GET", "/api/status.json", headers={"Host": name})
        r = c.getresponse()
        assert r.status == want, (name, r.status)
        assert r.getheader("X-Frame-Options") == "DENY" and r.getheader("X-Content-Type-Options") == "nosniff"
        assert "frame-ancestors 'none'" in r.getheader("Content-Security-Policy", ""), r.getheaders()
        c.close()
    assert get(url + "/metrics")[0] == 200   # still serving
    assert cli("status", "--state-dir", str(d.state_dir)).code == 0   # and the control plane too


def test_bad_metrics_addresses_are_usage_errors(tmp_path):
    for bad in ("nocolon", "127.0.0.1:http", "127.0.0.1:70000"):
        r = cli("scheduler", "--state-dir", str(tmp_path / "s"), "--metrics", bad)
        assert r.code == 2 and "--metrics" in r.err, (bad, r.err)
    r = cli("start", "--state-dir", str(tmp_path / "n"), "--scheduler", "tcp://127.0.0.1:1", "--scheduler-key",
            "x" * 40, "--metrics", "127.0.0.1:0")
    assert r.code == 2 and "elasticd scheduler" in r.err, r.err


def _dom(url: str, shot: Path | None = None) -> str:
    """The page's DOM after its scripts ran for a few seconds in headless chromium (a real browser)."""
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--virtual-time-budget=4000", "--window-size=1200,900"]
    if shot is not None:
        args.append(f"--screenshot={shot}")
    else:
        args.append("--dump-dom")
    r = subprocess.run([*args, url], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's `chromium` is not installed (scripts/setup.sh installs it "
                    "where apt can reach a mirror): the page's JSON and HTML are still tested over real HTTP above")
def test_a_person_sees_the_job_row_a_growing_chart_and_the_resize_mark(island, tmp_path):
    import re

    d, url, job = island

    def chart_points(dom: str) -> int:
        m = re.search(rf'<svg[^>]*class="chart"[^>]*data-job="{job}"[^>]*data-points="(\d+)"', dom)
        return int(m.group(1)) if m else 0

    first = wait_until(lambda: chart_points(_dom(url + "/")), 60, interval=0.5, what="the job's chart")
    assert 'class="mark resize"' not in _dom(url + "/")
    scale_to_1(d, job)   # while the page is being watched
    dom = wait_until(lambda: (lambda t: t if chart_points(t) > first and "mark resize" in t else None)(
        _dom(url + "/")), 60, interval=0.5, what="the chart to grow and show the resize")
    row = re.search(rf'<tr class="job" data-job="{job}" data-state="running">(.*?)</tr>', dom, re.S)
    assert row, dom[:3000]
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row.group(1))
    assert cells[1] == "demo" and cells[2] == "running" and cells[3] == "2 on 1", cells
    assert 'class="mark resize"' in dom and "2 → 1 devices (scale command): done" in dom
    shot = tmp_path / "status-page.png"
    _dom(url + "/", shot)
    assert shot.stat().st_size > 10_000   # a rendered page, not a blank one


def test_a_standalone_scheduler_serves_metrics_for_the_nodes_that_join_it(cluster):
    from cluster import Proc

    sd = cluster.root / "sched"
    sched = Proc(["scheduler", "--bind", "tcp://127.0.0.1:0", "--state-dir", str(sd), "--heartbeat", "0.1",
                  "--metrics", ":0"], sd, "scheduler.json")
    cluster.procs.append(sched)
    sched.start()
    url = sched.info()["metrics"]
    assert url.startswith("http://127.0.0.1:"), url   # ":PORT" is loopback
    assert value(samples(url), "elasticd_nodes", state="alive") == 0.0
    node_dir = cluster.root / "n1"
    key = cli("keygen", "--state-dir", str(node_dir)).out.strip()
    assert cli("keygen", "--state-dir", str(sd), "--allow", key, "--role", "node", "--node-id", "n1").code == 0
    cluster.daemon("n1", "--scheduler", sched.info()["tcp"], "--scheduler-key", str(sd / "keys" / "id.key"),
                   "--node-id", "n1", cpu=3)
    m = wait_until(lambda: (lambda m: m if value(m, "elasticd_nodes", state="alive") == 1.0 else None)(
        samples(url)), 30, interval=0.2, what="the node in the metrics")
    assert value(m, "elasticd_node_devices", node="n1", state="free") == 3.0


def test_the_charts_history_is_bounded_in_points_and_jobs():
    from elasticd.observe.snapshot import History

    h = History(points=3, jobs=2)
    row = {"step": 1, "steps_per_s": 1.0, "loss": 0.5, "devices": 1}
    for t in range(10):
        h.sample(float(t), [dict(row, job=f"j{k}", state="running") for k in range(4)],
                 [{"node": "n", "alive": True, "busy": 4}])
    series, alloc = h.frozen()
    assert sorted(series) == ["j2", "j3"]   # the newest, the same ones every time
    assert all(len(v) == 3 for v in series.values()) and len(alloc) == 3
    h.sample(11.0, [], [])   # every job purged from the table: their charts go too
    assert h.frozen()[0] == {}
