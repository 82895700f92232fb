"""Smoke runs of the benchmark scripts (`--quick`): they run end to end and end with `name=<float>`.

The figures themselves are not checked: they are measured on a shared machine and reported in the
README (benchmarks live in scripts/, not in timed tests). What is pinned is the contract other
tooling reads: the last line of stdout is exactly `name=value` with a float value.

The scripts whose runs only go through `elasticd run` (no look at their agents' processes, no start-up
timed) join the suite's shared fork servers, as every `elasticd run` the suite makes does (tests/conftest.py);
the others start their own, as a user's run does.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from util import REPO, shared_servers

LAST_LINE = re.compile(r"^([a-z_]+)=(-?[0-9]+(?:\.[0-9]+)?)$")
# Runs timed by the job's own step stamps, through `elasticd run` (and a daemon, which takes the shared server
# where its agents' start-up environment matches). Not bench_determinism.py and the others
# that interleave their runs (scripts/_interleave.py freezes each run's process tree: agents forked from a
# shared server are outside it) or pin them to cores (inherited from the launcher, not by a shared server's
# children).
ON_SHARED_SERVERS = {"bench_torchrun_mode.py", "bench_scheduled_resize.py"}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("script, name", [
    ("bench_multiplex.py", "vs_ddp_accumulation"),
    ("bench_handover.py", "handover_overhead"),
    ("bench_determinism.py", "deterministic_cost"),
    ("bench_resize.py", "resize_seconds"),
    ("bench_daemon_grow.py", "daemon_grow_ratio"),
    ("bench_scheduled_resize.py", "daemon_vs_run_pause"),
    ("bench_recovery.py", "recovery_seconds"),
    ("bench_torchrun_mode.py", "torchrun_mode_vs_torchrun"),
    ("bench_resize_memory.py", "rss_last_vs_first_resize"),
    ("bench_islands.py", "cross_island_bytes_ratio"),
    ("bench_islands_link.py", "two_islands_vs_one"),
    ("bench_island_loss.py", "island_loss_vs_node_loss"),
    ("bench_island_moves.py", "island_move_vs_node_move"),
])
def test_quick_run_ends_with_name_equals_float(script: str, name: str) -> None:
    env = {**os.environ, **(shared_servers() if script in ON_SHARED_SERVERS else {})}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / script), "--quick"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, f"{script} --quick failed:\n{proc.stdout}\n{proc.stderr}"
    lines = proc.stdout.strip().splitlines()
    assert lines, f"{script} printed nothing"
    m = LAST_LINE.match(lines[-1])
    assert m is not None, f"last line of {script} is not name=float: {lines[-1]!r}"
    assert m.group(1) == name
    assert math.isfinite(float(m.group(2))) and float(m.group(2)) > 0


HELPED = ["bench_multiplex.py", "bench_handover.py", "bench_determinism.py", "bench_resize.py",
          "bench_daemon_grow.py", "bench_scheduled_resize.py", "bench_torchrun_mode.py", "bench_resize_memory.py",
          "bench_islands.py", "bench_islands_link.py", "bench_island_loss.py", "bench_island_moves.py"]
# Each script's `-h` run as `python SCRIPT -h` runs it, in one interpreter for all of them: most import torch
# before they parse their arguments, seconds each.
HELP_DRIVER = """
import contextlib, io, json, runpy, sys
sys.path.insert(0, sys.argv[1])
out = {}
for script in sys.argv[2:]:
    sys.argv = [script, "-h"]
    text = io.StringIO()
    code = "no exit"
    with contextlib.redirect_stdout(text):
        try:
            runpy.run_path(script, run_name="__main__")
        except SystemExit as e:
            code = e.code
    out[script] = [code, text.getvalue()]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def helps() -> dict[str, list]:
    scripts = [str(REPO / "scripts" / s) for s in HELPED]
    proc = subprocess.run([sys.executable, "-c", HELP_DRIVER, str(REPO / "scripts"), *scripts], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {Path(k).name: v for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}


@pytest.mark.parametrize("script", HELPED)
def test_help_explains(helps: dict[str, list], script: str) -> None:
    code, text = helps[script]
    assert code in (0, None), (code, text)
    assert "--quick" in text and "=X.XX" in text, text


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_seeded_chaos_trials_all_recover_bitwise() -> None:
    """Two faults at seeded random moments (an agent stopped for good, which the watchdog must fence; a second
    kill during a recovery) against a deterministic job: each run must end exactly as an undisturbed one
    (scripts/chaos.py checks the digest)."""
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "chaos.py"), "--quick", "--seed", "1"], cwd=REPO,
                          capture_output=True, text=True, timeout=580)
    assert proc.returncode == 0, f"chaos.py failed:\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip().splitlines()[-1] == "recovered=2/2", proc.stdout
    # A stopped agent never finishes on its own, so the stop always lands: fenced, and recovered from once.
    stop = json.loads(proc.stdout.splitlines()[0])
    assert stop["fault"] == "stop" and stop["recoveries"] == 1 and "was stuck (stopped" in stop["causes"][0], stop
