"""Hooks registered on replicated state inside the function run for their own worker's passes, as each DDP
process's hooks run for its own: tests/jobs/hooks_job.py against real DDP, resized and on one device."""

from __future__ import annotations

from pathlib import Path

import pytest
from util import JOBS, REFERENCE_WORKERS, cli, load_state, rel_diffs

TOLERANCE = 1e-5  # as tests/test_equivalence.py: fp32 reordering of the gradient sum


@pytest.mark.timeout(900)
def test_gradient_and_forward_hooks_on_the_shared_model_act_once_per_pass_as_under_ddp(tmp_path: Path) -> None:
    env = {"ELASTICD_TEST_WORKERS": str(REFERENCE_WORKERS)}
    ddp = cli("run", str(JOBS / "hooks_job.py"), "--workers", str(REFERENCE_WORKERS), "--ddp",
              env={**env, "ELASTICD_TEST_OUT": str(tmp_path / "ddp.pt")}, timeout=400)
    assert ddp.code == 0, ddp.output
    want = load_state(tmp_path / "ddp.pt")
    # A fresh hook after a resize counts from zero under elasticd: compare counts on the unresized run only.
    assert want["calls"].tolist() == [8.0] * REFERENCE_WORKERS
    for name, args in (("scaled", ("--devices", "2", "--scale-at", "3:1")), ("one", ("--devices", "1"))):
        run = cli("run", str(JOBS / "hooks_job.py"), "--workers", str(REFERENCE_WORKERS), *args,
                  env={**env, "ELASTICD_TEST_OUT": str(tmp_path / f"{name}.pt")}, timeout=400)
        assert run.code == 0, run.output
        got = load_state(tmp_path / f"{name}.pt")
        model = {k: v for k, v in got.items() if k != "calls"}
        too_far = {k: d for k, d in rel_diffs({k: want[k] for k in model}, model).items() if d > TOLERANCE}
        assert not too_far, f"{name}: differs from DDP: {too_far}"
        if name == "one":
            assert got["calls"].tolist() == [8.0] * REFERENCE_WORKERS, got["calls"]
