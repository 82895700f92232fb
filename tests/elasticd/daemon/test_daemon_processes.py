"""The daemon's agent supervisor on its own: real processes (the fake agent), no sockets, no scheduler."""

from __future__ import annotations

import os
import shutil
import sys
import time

import psutil
import pytest
from cluster import FAKE_AGENT
from util import wait_until

from elasticd import protocol as p
from elasticd.daemon import supervision
from elasticd.daemon.devices import cpu_devices, discover
from elasticd.daemon.processes import AgentProcesses, open_agent_root
from elasticd.statedir import StateDir


@pytest.fixture
def sup(tmp_path):
    sd = StateDir(tmp_path / "state").create()
    open_agent_root(sd, shared=False, now=time.time())
    s = AgentProcesses(sd, cpu_devices(2), f"ipc://{tmp_path}/nobody.sock",
                       "127.0.0.1", agent_command=[sys.executable, str(FAKE_AGENT)])
    yield s
    s.shutdown(timeout_s=2.0)
    shutil.rmtree(sd.agent_root, ignore_errors=True)


def launch(sup: AgentProcesses, job: str, env: dict[str, str], devices=("cpu:0", "cpu:1")) -> bool:
    return sup.launch(p.LaunchJob(job_id=job, script="/s.py", func=None, workers=4, devices=len(devices),
                                  placements=[p.RankPlacement(rank=r, device_id=d) for r, d in enumerate(devices)],
                                  master_addr="127.0.0.1", master_port=0, cwd=os.getcwd(), env=env), time.time())


def report(sup: AgentProcesses, job: str) -> p.JobReport:
    sup.poll(time.time())
    return next(r for r in sup.reports() if r.job_id == job)


def test_agents_run_to_exit_0(sup):
    assert launch(sup, "j1", {"FAKE_STEPS": "3"})
    r = report(sup, "j1")
    assert r.state == "launching" and r.master_port > 0 and sorted(r.ranks) == [0, 1]
    r = wait_until(lambda: (x := report(sup, "j1")).state == "ended" and x, 20)
    assert r.ok and r.error is None and [a.exitcode for a in r.agents] == [0, 0]
    assert "fake agent 0/2 of j1" in (sup.sd.log_dir("j1") / "rank0.log").read_text()
    sup.forget(["j1"])
    assert sup.reports() == []


def test_failure_report_comes_from_the_error_file_and_siblings_are_stopped(sup):
    # rank 1 fails at once; rank 0 would run forever: it must be terminated, not waited for
    assert launch(sup, "j2", {"FAKE_MODE": "fail", "FAKE_STEPS": "1", "FAKE_ONLY_RANK": "1"})
    r = wait_until(lambda: (x := report(sup, "j2")).state == "ended" and x, 20)
    assert not r.ok and r.error["message"] == "ValueError: fake failure" and r.error["rank"] == 1
    assert {a.rank: a.exitcode for a in r.agents} == {0: -15, 1: 1}


def test_agent_dying_without_a_report_gets_a_synthesised_error_with_its_log_tail(sup):
    assert launch(sup, "j3", {"FAKE_MODE": "crash"})
    r = wait_until(lambda: (x := report(sup, "j3")).state == "ended" and x, 20)
    assert not r.ok and "exited with code 3" in r.error["message"] and "crashing hard" in r.error["log_tail"]
    assert 3 in [a.exitcode for a in r.agents]


def test_stop_escalates_from_command_to_sigterm(sup, monkeypatch):
    monkeypatch.setattr(supervision, "STOP_GRACE_S", 0.3)
    assert launch(sup, "j4", {"FAKE_MODE": "deaf"})
    pids = [a.pid for a in report(sup, "j4").agents]
    assert sup.kill("j4", "test", time.time()) == []    # nobody said hello: no command to send, only signals
    r = wait_until(lambda: (x := report(sup, "j4")).state == "ended" and x, 20)
    assert not r.ok and all(a.exitcode == -15 for a in r.agents)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)


def test_launch_on_unknown_device_is_refused_with_a_reason(sup):
    assert not launch(sup, "j5", {}, devices=("cuda:7",))
    r = report(sup, "j5")
    assert r.state == "ended" and not r.ok and "cuda:7" in r.error["message"]


def test_repeated_launch_is_idempotent(sup):
    assert launch(sup, "j6", {"FAKE_MODE": "hang"})
    first = [a.pid for a in report(sup, "j6").agents]
    assert launch(sup, "j6", {"FAKE_MODE": "hang"})
    assert [a.pid for a in report(sup, "j6").agents] == first


def test_device_discovery():
    assert [d.device_id for d in discover(3)] == ["cpu:0", "cpu:1", "cpu:2"]
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    found = discover(None)
    assert [d.device_id for d in found] == ([f"cuda:{i}" for i in range(n)] if n else ["cpu:0"])
