"""Once-per-step idioms on replicated state: N=4 logical workers vs real DDP.

With `ctx.replicate`, hosted workers share one model, one `.grad` and one optimizer, and after the
gradient flush the first hosted worker runs its post-backward code and its next step's backward before
the second worker runs its post-backward code. Each job in IDIOM_JOBS does, after backward, something to
shared state that torch users write without `ctx` helpers — torch's clipping functions by two names,
the `GradScaler` loop, LR schedulers each rank builds over the replicated optimizer — and must end where
`torch.nn.parallel.DistributedDataParallel` with 4 gloo processes ends (agent/ddp_reference.py), on 1
and 2 devices and across a live resize. The jobs also check inside the run that every rank saw the same
values (total norms, scales, learning rates), as every DDP rank does.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from util import JOBS, REFERENCE_WORKERS, Reference, cli, load_state, rel_diff, rel_diffs

IDIOM_JOBS = ["clip_torch", "grad_scaler", "sched_after", "sched_before", "sched_plateau"]
TOLERANCE = 1e-5  # max|Δ| / max|p| per tensor, as in tests/system/test_equivalence.py
MOVED = 1e-3      # the reference must have trained, or an equal result proves nothing
RUN_TIMEOUT = 300.0


def _elasticd(job: str, devices: int, out: Path, scale_at: str = "") -> None:
    args = ["run", str(JOBS / f"{job}.py"), "--workers", str(REFERENCE_WORKERS), "--devices", str(devices)]
    if scale_at:
        args += ["--scale-at", scale_at]
    env = {"ELASTICD_TEST_WORKERS": str(REFERENCE_WORKERS), "ELASTICD_TEST_OUT": str(out)}
    run = cli(*args, env=env, timeout=RUN_TIMEOUT)
    assert run.code == 0, f"elasticd {' '.join(args)} exited {run.code}:\n{run.output}"
    assert out.exists(), f"logical rank 0 wrote no result:\n{run.output}"
    if scale_at:
        assert "resized 2 -> 1 devices" in run.output, f"the job did not resize:\n{run.output}"


def _assert_like_ddp(job: str, ref: Reference, out: Path, what: str) -> None:
    moved = {n: rel_diff(ref.final[n], ref.initial[n]) for n in ref.initial if ref.initial[n].is_floating_point()}
    assert min(moved.values()) > MOVED, f"{job}: the DDP reference barely trained: {moved}"
    diffs = rel_diffs(ref.final, load_state(out))
    print(f"{job} {what}: max rel diff vs DDP {max(diffs.values()):.3g}")
    too_far = {name: d for name, d in diffs.items() if d > TOLERANCE}
    assert not too_far, f"{job} {what} differs from DDP (max|Δ|/max|p| per tensor): {too_far}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("job", IDIOM_JOBS)
def test_idiom_matches_ddp(job: str, devices: int, ddp_reference: Callable[[str], Reference],
                           tmp_path: Path) -> None:
    ref = ddp_reference(job)
    out = tmp_path / "final.pt"
    _elasticd(job, devices, out)
    _assert_like_ddp(job, ref, out, f"on {devices} devices")


@pytest.mark.timeout(900)
@pytest.mark.parametrize("job", IDIOM_JOBS)
def test_idiom_survives_a_resize(job: str, ddp_reference: Callable[[str], Reference], tmp_path: Path) -> None:
    """2 devices, then 1 after step 6: schedulers and scalers the job built itself must carry over."""
    ref = ddp_reference(job)
    out = tmp_path / "final.pt"
    _elasticd(job, 2, out, scale_at="6:1")
    _assert_like_ddp(job, ref, out, "resized 2 -> 1 at step 6")


@pytest.mark.timeout(300)
def test_scheduler_step_with_a_per_rank_metric_fails_loudly(tmp_path: Path) -> None:
    """`plateau.step(local_loss)`: DDP ranks would drift apart; one shared lr cannot, so it must raise."""
    args = ["run", str(JOBS / "sched_plateau.py"), "--workers", str(REFERENCE_WORKERS), "--devices", "1"]
    env = {"ELASTICD_TEST_WORKERS": str(REFERENCE_WORKERS), "ELASTICD_TEST_OUT": str(tmp_path / "final.pt"),
           "ELASTICD_TEST_PER_RANK_METRIC": "1"}
    run = cli(*args, env=env, timeout=RUN_TIMEOUT)
    assert run.code != 0, f"a per-rank metric must fail the run:\n{run.output}"
    assert "ReduceLROnPlateau.step() got different arguments on logical rank" in run.output, run.output
    assert not (tmp_path / "final.pt").exists()
