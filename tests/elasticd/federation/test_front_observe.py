"""A federation front's metrics and status page (`elasticd federation --metrics`): two island schedulers
with a node of fake agents each, a job spanning both; what Prometheus scrapes, what the page polls."""

from __future__ import annotations

import json

from cluster import Cluster, status
from scrape import get, samples, value
from util import JOBS, cli, wait_until

FAKE_SCRIPT = str(JOBS / "fake_agent.py")


def test_the_front_shows_its_jobs_with_their_portions_per_island_and_its_islands(tmp_path):
    c = Cluster(tmp_path)
    try:
        front = c.federation("front", 2.0, "--metrics", "127.0.0.1:0")
        url = front.info()["metrics"]
        assert url.startswith("http://127.0.0.1:"), url
        for name in ("A", "B"):
            c.node(c.island(front, name), f"{name.lower()}1", cpu=2)
        m = wait_until(lambda: (m := samples(url)) and value(m, "elasticd_island_up", island="B") == 1 and m, 60,
                       what="both islands up in the front's metrics")
        assert value(m, "elasticd_island_devices", island="A", state="free") == 2
        r = cli("submit", FAKE_SCRIPT, "--workers", "8", "--islands", "A,B", "--name", "wide", "--env",
                "FAKE_MODE=hang", "--env", "FAKE_STEP_S=0.05", "--state-dir", str(front.state_dir))
        assert r.code == 0, r.err
        job = r.out.strip()
        m = wait_until(lambda: (m := samples(url)) and value(m, "elasticd_front_jobs", state="running") == 1 and m,
                       60, what="the job running in the front's metrics")
        for island in ("A", "B"):
            assert value(m, "elasticd_front_job_devices", job=job, name="wide", island=island) == 2
            assert value(m, "elasticd_front_job_workers", job=job, name="wide", island=island) == 4
            assert value(m, "elasticd_island_devices", island=island, state="busy") == 2
        assert value(m, "elasticd_front_job_restarts_total", job=job, name="wide") == 0
        assert value(m, "elasticd_front_request_duration_seconds_count", op="island_status") > 0
        code, text = get(url + "/api/status.json")
        assert code == 200
        (row,) = json.loads(text)["jobs"]
        assert (row["job"], row["state"], [(pt["island"], pt["ranks"]) for pt in row["portions"]]) == (
            job, "running", [("A", "0-1"), ("B", "2-3")])
        code, page = get(url + "/")
        assert code == 200 and "elasticd federation front" in page and "/api/status.json" in page
        assert cli("stop", job, "--state-dir", str(front.state_dir)).code == 0
        wait_until(lambda: value(samples(url), "elasticd_front_jobs", state="stopped") == 1, 30,
                   what="the job stopped in the front's metrics")
        assert value(samples(url), "elasticd_front_job_devices", job=job, name="wide", island="A") is None
    finally:
        c.cleanup()


def test_a_front_killed_and_restarted_goes_on_with_its_jobs(tmp_path):
    """The front's table is on disk: SIGKILLed and started again on its address, it knows its job spanning
    islands again as the islands report its portions, and can still stop it everywhere."""
    c = Cluster(tmp_path)
    try:
        front = c.federation("front", 2.0)
        islands = [c.island(front, name) for name in ("A", "B")]
        for isl in islands:
            c.node(isl, f"{isl.state_dir.name.lower()}1", cpu=2)
        wait_until(lambda: len(spans_of(front, "")) == 0 and islands_up(front) == 2, 60, what="both islands up")
        r = cli("submit", FAKE_SCRIPT, "--workers", "8", "--islands", "A,B", "--env", "FAKE_MODE=hang", "--env",
                "FAKE_STEP_S=0.05", "--state-dir", str(front.state_dir))
        assert r.code == 0, r.err
        job = r.out.strip()
        wait_until(lambda: spans_of(front, job)[0]["state"] == "running", 60, what="the job running")
        front.kill()
        front.argv[front.argv.index("--bind") + 1] = front.info()["tcp"]   # where its islands look for it
        front.start()
        again = wait_until(lambda: (s := spans_of(front, job)[0])["state"] == "running"
                           and all(pt["state"] == "running" for pt in s["portions"]) and s, 60,
                           what="the restarted front to see its job's portions again")
        assert [(pt["island"], pt["ranks"]) for pt in again["portions"]] == [("A", "0-1"), ("B", "2-3")]
        assert again["restarts"] == 0 and again["attempt"] == 1
        assert cli("stop", job, "--state-dir", str(front.state_dir)).code == 0
        for isl in islands:
            wait_until(lambda isl=isl: [j["state"] for j in status(isl.state_dir)["jobs"]] == ["stopped"], 30,
                       what=f"its portion stopped on {isl.state_dir.name}")
        r = cli("submit", FAKE_SCRIPT, "--workers", "2", "--islands", "A", "--state-dir", str(front.state_dir))
        assert r.code == 0 and r.out.strip() != job, r   # ids go on from where they were
    finally:
        c.cleanup()


def spans_of(front, job: str) -> list[dict]:
    r = cli("islands", "--jobs", *([job] if job else []), "--json", "--state-dir", str(front.state_dir))
    assert r.code == 0, r
    return r.json()["jobs"]


def islands_up(front) -> int:
    r = cli("islands", "--json", "--state-dir", str(front.state_dir))
    return sum(i["state"] == "up" for i in r.json()["islands"]) if r.code == 0 else 0
