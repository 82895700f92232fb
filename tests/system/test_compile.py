"""`torch.compile` inside an elastic job: the compiled replicated model trains as the eager one does under
DDP (to round-off) and, in deterministic mode, bitwise the same on 1 device and on 2 resized live to 1 and
back (the compiled code is shared by the workers' threads and survives the re-layout)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from util import JOBS, max_rel_diff

# Long end-to-end runs (torch.compile in every agent): run by CI's second pass, not the README's.
pytestmark = pytest.mark.slow

JOB = str(JOBS / "compiled.py")


def run(tmp: Path, name: str, *args: str, env: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    out = tmp / f"{name}.pt"
    proc = subprocess.run([sys.executable, "-m", "elasticd", "run", JOB, *args],
                          env={**os.environ, **(env or {}), "ELASTICD_TEST_OUT": str(out)}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # dynamo had traced the buffer hooks, guarded on the running worker's step, and compiled again at every
    # step until its limit, then ran the model uncompiled (right numbers, no compilation)
    assert "recompile_limit" not in proc.stderr, proc.stderr[-3000:]
    return {k.removeprefix("module."): v for k, v in torch.load(out).items()}


def test_a_compiled_model_is_bitwise_the_same_on_every_m_across_resizes_and_matches_ddp(tmp_path: Path) -> None:
    one = run(tmp_path, "m1", "--devices", "1")
    resized = run(tmp_path, "m2", "--devices", "2", "--scale-at", "7:1,14:2")
    assert set(one) == set(resized)
    for k in one:
        assert torch.equal(one[k], resized[k]), f"{k} differs bitwise between M=1 and the resized M=2 run"
    ddp = run(tmp_path, "ddp", "--ddp")
    assert set(ddp) == set(one)
    assert max_rel_diff(ddp, one) <= 1e-5


def test_a_compiled_model_with_batchnorm_is_compiled_once_and_matches_ddp(tmp_path: Path) -> None:
    env = {"ELASTICD_TEST_BN": "1", "ELASTICD_TEST_BACKEND": "aot_eager"}   # dynamo's tracing, no C++ build
    one = run(tmp_path, "m1", "--devices", "1", env=env)
    ddp = run(tmp_path, "ddp", "--ddp", env=env)
    assert "1.running_mean" in one
    assert max_rel_diff(ddp, one) <= 1e-5
