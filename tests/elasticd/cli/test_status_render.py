"""What `elasticd status` and `elasticd logs` print for a job, from the typed replies they get: an ended
job shows no pending scale request, the resize column names what did not take effect by outcome, and a
log line names its agent and the logical ranks that agent hosts."""

from __future__ import annotations

import dataclasses

from elasticd.cli.logs import _who
from elasticd.cli.status import _fmt_resizes, render, render_job
from elasticd.core.lifecycle import JOB_ENDED
from elasticd.core.records import ResizeEntry
from elasticd.protocol import JobInfo, StatusReply
from elasticd.scheduler.jobs import JobState


def _job(**kw: object) -> JobInfo:
    base = JobInfo(job_id="j1", name="", state="running", workers=8, devices=2, min_devices=1, max_devices=4,
                   priority=0, nodes=["n1"])
    return dataclasses.replace(base, **kw)


def _resize(src: int, dst: int, outcome: str) -> ResizeEntry:
    return ResizeEntry(src=src, dst=dst, outcome=outcome, at=0.0, why="scale")


def test_a_finished_job_shows_no_pending_scale_request() -> None:
    ended = _job(state="finished", devices=1, requested_devices=2)
    assert "requested" not in render_job(ended)
    assert "(->2)" not in render(StatusReply(jobs=[ended], nodes=[]))
    running = _job(devices=1, requested_devices=2)
    assert "scale to 2 requested" in render_job(running)
    assert "1 (->2)" in render(StatusReply(jobs=[running], nodes=[]))
    assert "requested" not in render_job(_job(devices=2, requested_devices=2))   # there already


def test_the_resize_column_names_what_did_not_take_effect() -> None:
    assert _fmt_resizes([]) == "-"
    assert _fmt_resizes([_resize(4, 2, "done"), _resize(2, 1, "done")]) == "4->2->1"
    assert _fmt_resizes([_resize(2, 1, "restarted")]) == "2->1"   # torchrun mode: restarted at the new size
    assert _fmt_resizes([_resize(2, 1, "refused")]) == "none (1 refused)"
    assert _fmt_resizes([_resize(4, 2, "done"), _resize(2, 1, "rolled back"), _resize(2, 1, "refused")]) \
        == "4->2 (1 refused, 1 rolled back)"


def test_the_ended_states_are_the_scheduler_s() -> None:
    assert set(JOB_ENDED) == {JobState.FINISHED.value, JobState.FAILED.value, JobState.STOPPED.value}


def test_a_log_line_names_its_agent_and_the_ranks_it_hosts() -> None:
    assert _who("rank0.log", _job()) == "agent 0, ranks 0-3"
    assert _who("rank1.log", _job(blocks=[6, 2])) == "agent 1, ranks 6-7"
    assert _who("rank0.log", _job(workers=2, devices=2)) == "agent 0, rank 0"
    assert _who("rank3.log", _job()) == "agent 3"                 # an agent of an earlier, larger size
    assert _who("rank0.log", _job(state="queued", devices=0)) == "agent 0"
    assert _who("spares.log", _job()) == "spares"
