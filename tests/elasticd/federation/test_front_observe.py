"""A federation front's metrics and status page (`elasticd federation --metrics`): two island schedulers
with a node of fake agents each, a job spanning both; what Prometheus scrapes, what the page polls."""

from __future__ import annotations

import json

from cluster import Cluster
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
