"""elasticd/local_node.py: the node and scheduler `elasticd run` drives in its own process. What a run does
through it is tested by every file that drives `elasticd run`; these pin what the node is given."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from elasticd.local_node import LocalNode


def test_a_cuda_runs_node_serves_the_devices_the_run_asked_for_without_probing_the_machine() -> None:
    """The run checked its GPUs itself (more agents than GPUs only under the gloo test switch, where several
    share one); a probe of the machine would give a node with fewer devices than the job needs, on which
    it would wait for devices for ever."""
    node = LocalNode(3, "cuda")
    try:
        assert [(d.device_id, d.type, d.index) for d in node.daemon.devices] == [
            ("cuda:0", "cuda", 0), ("cuda:1", "cuda", 1), ("cuda:2", "cuda", 2)]
    finally:
        node.close()


def test_a_cpu_runs_node_serves_one_cpu_device_per_agent() -> None:
    node = LocalNode(2, "cpu")
    try:
        assert [(d.device_id, d.type) for d in node.daemon.devices] == [("cpu:0", "cpu"), ("cpu:1", "cpu")]
    finally:
        node.close()


JOB = """
import torch

import elasticd


@elasticd.elastic(workers=2)
def train(ctx):
    model = torch.nn.Linear(4, 1)
    model, opt = ctx.replicate(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in ctx.steps(12):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
"""


def test_a_run_gives_back_its_snapshot_dir_as_it_found_it(tmp_path: Path) -> None:
    """--snapshot-dir is the user's: the periodic snapshots the agents wrote there go once the run is over,
    and what was there before stays."""
    (tmp_path / "job.py").write_text(JOB)
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    (snaps / "mine.txt").write_text("the user's")
    run = subprocess.run([sys.executable, "-m", "elasticd", "run", "job.py", "--devices", "2", "--snapshot-every", "2",
                          "--snapshot-dir", str(snaps)], cwd=tmp_path, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(os.listdir(snaps)) == ["mine.txt"]
