"""CPU agents of `elasticd run` each get a block of cores of their own, re-cut at a resize, and
ELASTICD_CPU_PIN=0 leaves the OS free to place them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from util import JOBS, cli

from elasticd.agent.cpu_pin import core_block

CORES = sorted(os.sched_getaffinity(0))


def test_core_block_cuts_equal_disjoint_blocks() -> None:
    assert [core_block(s, 2, [0, 1, 2, 3, 4]) for s in range(2)] == [[0, 1], [2, 3]]
    assert core_block(1, 2, [4, 6]) == [6]
    # Fewer cores than slots, or a slot outside the count: share every core rather than pile up.
    assert core_block(2, 3, [0, 1]) == [0, 1]
    assert core_block(3, 2, [0, 1]) == [0, 1]


def probe(tmp: Path, scale_at: str, env: dict[str, str]) -> dict[int, list[dict]]:
    """step -> the lines every logical worker wrote at that step."""
    cmd = [sys.executable, "-m", "elasticd", "run", str(JOBS / "pin_probe.py"), "--devices", "2"]
    if scale_at:
        cmd += ["--scale-at", scale_at]
    proc = subprocess.run(cmd, env={**os.environ, "ELASTICD_TEST_LOG": str(tmp), **env},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_probe(tmp)


def read_probe(tmp: Path) -> dict[int, list[dict]]:
    steps: dict[int, list[dict]] = {}
    for path in tmp.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            steps.setdefault(rec["step"], []).append(rec)
    assert sorted(steps) == list(range(8)) and all(len(v) == 4 for v in steps.values()), steps
    return steps


@pytest.mark.skipif(len(CORES) < 2, reason="pinning two agents apart needs two cores")
def test_agents_pin_apart_and_repin_after_a_shrink(tmp_path: Path) -> None:
    steps = probe(tmp_path, "3:1", {})
    k = len(CORES) // 2
    before = {r["pid"]: (tuple(r["cores"]), r["threads"]) for r in steps[1]}
    assert sorted(before.values()) == [(tuple(CORES[:k]), k), (tuple(CORES[k:2 * k]), k)], before
    after = {(r["pid"], tuple(r["cores"]), r["threads"]) for s in range(4, 8) for r in steps[s]}
    assert len(after) == 1 and list(after)[0][1:] == (tuple(CORES), len(CORES)), after


def test_pinning_can_be_turned_off(tmp_path: Path) -> None:
    steps = probe(tmp_path, "", {"ELASTICD_CPU_PIN": "0"})
    assert {tuple(r["cores"]) for s in steps.values() for r in s} == {tuple(CORES)}


@pytest.mark.skipif(len(CORES) < 2, reason="pinning two agents apart needs two cores")
def test_daemon_pins_its_cpu_devices_agents_with_pin_cpus(cluster, tmp_path: Path) -> None:
    d = cluster.daemon("node", "--pin-cpus", cpu=2, fake=False)
    r = cli("submit", str(JOBS / "pin_probe.py"), "--min-devices", "2", "--wait", "--env",
            f"ELASTICD_TEST_LOG={tmp_path}", "--state-dir", str(d.state_dir), timeout=300)
    assert r.code == 0, (r.out, r.err, d.output()[-3000:])
    k = len(CORES) // 2
    agents = {(r["pid"], tuple(r["cores"]), r["threads"]) for s in read_probe(tmp_path).values() for r in s}
    assert sorted(a[1:] for a in agents) == [(tuple(CORES[:k]), k), (tuple(CORES[k:2 * k]), k)], agents
