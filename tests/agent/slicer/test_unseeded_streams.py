"""Random streams a job never seeds are per rank, as per process under DDP; seeded ones stay shared.

Under DDP each rank is a process, and this torch, Python and numpy seed a fresh process's generators from
the OS: a function that draws without seeding (an unseeded dropout mask, synthetic batch, shuffle) draws
numbers of its own on every rank, while a seed set at the top of the script, once per process, gives
every rank the same stream. Workers of one agent share a process, so the runtime gives each its own
streams where nothing seeded the process's (agent/slicer/rng.py). Against the real thing:
`elasticd run --ddp` runs the script as N processes of torch DDP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from util import JOBS, cli

SCRIPT = str(JOBS / "unseeded_draws.py")
RANKS = 4


def distinct(tmp: Path, env: dict[str, str], *how: str) -> dict[str, int]:
    """How many different values the 4 ranks drew, per stream, run `how`: CLI arguments, or `python`."""
    out = tmp / "-".join(how)
    env = {**env, "UNSEEDED_OUT": str(out)}
    if how == ("python",):   # the decorated function called in the script's own process
        run = subprocess.run([sys.executable, SCRIPT], env={**os.environ, **env}, capture_output=True, text=True,
                             timeout=240)
        assert run.returncode == 0, run.stdout + run.stderr
    else:
        r = cli("run", *how, SCRIPT, env=env, timeout=240)
        assert r.code == 0, r.output
    draws = [json.loads(Path(f"{out}{rank}.json").read_text()) for rank in range(RANKS)]
    return {k: len({json.dumps(d[k]) for d in draws}) for k in draws[0]}


@pytest.mark.parametrize("top", ["", "seed"])
def test_unseeded_streams_are_per_rank_and_seeded_ones_shared_as_under_ddp(tmp_path: Path, top: str) -> None:
    env = {"UNSEEDED_TOP": top}
    ddp = distinct(tmp_path, env, "--ddp")
    ours = distinct(tmp_path, env, "--devices", "2")   # two ranks per agent: each pair shares a process
    assert ours == ddp, (ours, ddp)
    standalone = distinct(tmp_path, env, "python")
    assert standalone == ddp, (standalone, ddp)
    if top:
        assert set(ours.values()) == {1}, ours
    else:   # a torch that starts every process from a constant seed would read 1 for torch, in both
        assert ours["python"] == ours["numpy"] == RANKS, ours
        assert ours["torch"] == ours["torch_after"] in (1, RANKS), ours
