"""The step-boundary vote travels inside the gradient flush (agent/comm/carried_vote.py): the encoding gives
the maximum over agents, a step with a flush costs one whole-group collective instead of two, a step whose
last collective is not a flush still votes apart, and a resize scheduled at a step still lands at that
step's boundary, in default and in deterministic mode. Real agent processes over gloo (`elasticd run`)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from util import JOBS

from elasticd.agent.comm.carried_vote import CarriedVote, decode, encode

JOB = str(JOBS / "vote_job.py")
LEVELS = (2, 2)


def test_summed_thermometers_decode_to_the_maximum_over_agents() -> None:
    values = list(itertools.product(range(LEVELS[0] + 1), range(LEVELS[1] + 1)))
    for agents in itertools.product(values, repeat=3):
        sums = [sum(col) for col in zip(*(encode(v, LEVELS) for v in agents), strict=True)]
        assert decode(sums, LEVELS) == tuple(max(v[i] for v in agents) for i in range(2)), agents


def test_a_carried_vote_decides_only_the_boundary_right_after_its_flush() -> None:
    """The flush casts the vote for the step in progress; the boundary takes it only if no whole-group
    collective came between (the count is the same on every agent) and the step matches, and only once."""
    vote = CarriedVote(LEVELS)
    cast = iter([(7, (1, 0)), (7, (2, 0)), (8, (0, 2))])
    vote.cast = lambda: next(cast)

    def flush(collectives_after: int) -> None:
        ballot = vote.ballot(torch.float32, torch.device("cpu"))
        assert vote.ballot(torch.float32, torch.device("cpu")) is None, "one ballot per flush"
        vote.summed((ballot * 2).tolist())   # two agents voting alike
        vote.end_flush(collectives_after)

    flush(10)
    assert vote.take(7, 10) == (1, 0)
    assert vote.take(7, 10) is None, "taken once"
    flush(11)
    assert vote.take(8, 11) is None, "cast for another step"
    flush(12)
    assert vote.take(8, 13) is None, "a collective after the flush: the agents vote apart"
    assert vote.ballot(torch.int64, torch.device("cpu")) is None, "only fp32/fp64 sums are exact counts"


def test_a_vote_outside_its_levels_is_refused() -> None:
    with pytest.raises(ValueError):
        encode((3, 0), LEVELS)


MODES = pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])


def run(tmp: Path, devices: int, deterministic: bool, scale_at: str = "") -> list[dict]:
    out = tmp / f"seen-{devices}-{scale_at or 'none'}.json"
    cmd = [sys.executable, "-m", "elasticd", "run", JOB, "--devices", str(devices)]
    if scale_at:
        cmd += ["--scale-at", scale_at]
    env = {**os.environ, "ELASTICD_TEST_OUT": str(out), "ELASTICD_TEST_DETERMINISTIC": str(int(deterministic))}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in out.read_text().splitlines()]


@MODES
def test_a_step_with_a_flush_votes_inside_it_and_one_without_votes_apart(tmp_path: Path, deterministic: bool) -> None:
    seen = run(tmp_path, devices=2, deterministic=deterministic)
    assert [s["step"] for s in seen] == list(range(12)), seen
    spent = {a["step"]: b["collectives"] - a["collectives"] for a, b in zip(seen, seen[1:], strict=False)}
    # Step 5 adds a ctx.all_reduce after its flush: flush, all-reduce, then the vote of its own. (The
    # model is small, so a deterministic flush or all-reduce is one gather, not an all-to-all and a gather.)
    assert spent == {s: 3 if s == 5 else 1 for s in range(11)}, spent


@MODES
def test_a_resize_scheduled_at_a_step_lands_at_that_boundary(tmp_path: Path, deterministic: bool) -> None:
    seen = run(tmp_path, devices=2, deterministic=deterministic, scale_at="3:1,5:2")
    # Step 3's vote rode its flush, step 5's was apart (its last collective is the ctx.all_reduce).
    assert [s["step"] for s in seen] == list(range(12)), seen
    assert [s["agents"] for s in seen] == [2] * 4 + [1] * 2 + [2] * 6, seen
