"""What a job reports cannot cost its node its membership: `ctx.log` values are bounded (protocol/limits.py:
MAX_METRICS values, strings of MAX_METRIC_CHARS), and a node cuts its jobs' reports, never its heartbeat,
to fit the frame cap. A node declared lost takes every job on it, other owners' too."""

from __future__ import annotations

from cluster import status
from daemon_jobs import submit_fake
from node_core import T0, Node, running
from util import cli, wait_until

from elasticd import protocol as p
from elasticd.daemon.supervision import HEARTBEAT_BUDGET, Supervision
from elasticd.protocol.limits import MAX_METRIC_CHARS, MAX_METRICS


def test_jobs_logging_megabytes_of_strings_leave_their_node_up_and_the_other_jobs_running(cluster):
    """Two jobs log 16 strings of 60,000 characters at every step (~1 MB a report each, the frame cap is
    1 MiB) for longer than the node timeout (5 s here): the node keeps heartbeating, every job keeps
    running, and status shows the strings cut to MAX_METRIC_CHARS."""
    d = cluster.daemon(cpu=3)
    sd = d.state_dir
    loud = [submit_fake(sd, "--workers", "1", FAKE_MODE="hang", FAKE_STEP_S="0.05", FAKE_LOG_CHARS="60000")
            for _ in range(2)]
    quiet = submit_fake(sd, "--workers", "1", FAKE_MODE="hang", FAKE_STEP_S="0.05")
    # 150 steps of 0.05 s: past the node timeout of 5 s, heartbeating every 0.1 s all along.
    info = wait_until(lambda: (j := {x["job_id"]: x for x in status(sd)["jobs"]})[loud[0]]["step"] >= 150 and j,
                      120, interval=0.2, what="150 steps of a loud job")
    shown = status(sd)
    assert [n["alive"] for n in shown["nodes"]] == [True], shown["nodes"]
    assert {info[j]["state"] for j in (*loud, quiet)} == {"running"}, info
    for job in loud:
        notes = {k: v for k, v in info[job]["metrics"].items() if k.startswith("note")}
        assert len(notes) == 16 and {len(v) for v in notes.values()} == {MAX_METRIC_CHARS}, info[job]["metrics"]
    events = cli("events", "--json", "--state-dir", str(sd))
    assert "node_lost" not in events.out, events.out[-2000:]
    for job in (*loud, quiet):
        assert cli("stop", job, "--state-dir", str(sd)).code == 0


def test_reports_too_large_for_one_heartbeat_lose_their_text_not_the_heartbeat() -> None:
    """Many failed jobs, each with the longest error a report keeps: the reports are cut, largest first, to
    fit the frame cap, and each keeps its state and the start of its error."""
    sup = Supervision([])
    reports = [p.JobReport(job_id=f"j{i}", state="ended", ranks=[0], master_port=0, ok=False,
                           metrics={"phase": "x" * 256},
                           error={"message": f"job {i} failed: " + "m" * 60000, "traceback": "t" * 65536})
               for i in range(24)]
    assert sum(p.encoded_size(r) for r in reports) > p.MAX_FRAME_BYTES
    fitted = sup._fit(reports)
    assert sum(p.encoded_size(r) for r in fitted) <= HEARTBEAT_BUDGET
    status_msg = p.NodeStatus(node_id="n", seq=1, jobs=fitted)
    assert len(status_msg.encode()) < p.MAX_FRAME_BYTES
    assert [r.state for r in fitted] == ["ended"] * 24
    assert all(r.error is not None and r.error["message"].startswith(f"job {i} failed") for i, r in enumerate(fitted))


def test_an_agent_that_bypasses_ctx_log_is_bounded_by_its_node() -> None:
    """The node keeps at most MAX_METRICS values of MAX_METRIC_CHARS from an agent's step report, whatever the
    agent sent (a hostile agent need not use ctx.log)."""
    node = Node()
    idents = running(node)
    big = {f"k{i}": "v" * 10000 for i in range(200)}
    assert node.core.agent_message(idents[0], p.AgentStep(job_id="j", rank=0, step=1, metrics=big), T0)[0] is None
    kept = node.report("j").metrics
    assert len(kept) == MAX_METRICS and {len(v) for v in kept.values()} == {MAX_METRIC_CHARS}, len(kept)
