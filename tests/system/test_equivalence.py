"""DDP equivalence (docs/architecture.md, what must hold, 1): N=4 logical workers on M=1, 2, 4 devices vs real DDP.

Each job in tests/jobs/ is run once under `torch.nn.parallel.DistributedDataParallel` with 4 gloo
processes (agent/ddp_reference.py) and through `elasticd run` on M devices; logical rank 0's final state_dict
(params and buffers) must agree tensor by tensor within fp32 round-off.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import pytest
from util import (
    JOBS,
    REFERENCE_WORKERS,
    CliResult,
    Reference,
    cli,
    load_state,
    rel_diff,
    rel_diffs,
    session_pids,
    wait_until,
)

from elasticd.forked import SHARED_DIR_VAR
from elasticd.reference_launch import run_native_ddp

EQUIVALENCE_JOBS = ["mlp_sgd", "cnn_bn", "tiny_lm", "accum_nosync"]
TOLERANCE = 1e-5  # max|Δ| / max|p| per tensor: local pre-summation reorders fp32 additions, nothing more
MOVED = 1e-3      # every float tensor must have moved 100x further than the tolerance during training
RUN_TIMEOUT = 300.0
FAILURE_DEADLINE = 120.0  # a raising worker must end the run well before this


# 1 KiB gradient buckets: these small models would fit one bucket of the default size, reduced at the flush;
# at 1 KiB nearly every parameter has its own, started while the last hosted worker's backward runs
# (agent/replicated/buckets.py), so the overlapped flush is what is compared with DDP.
SMALL_BUCKETS = {"ELASTICD_BUCKET_KB": "1"}


def elasticd_run(script: Path, devices: int, env: dict[str, str] | None = None, *more: str) -> CliResult:
    args = ["run", str(script), "--workers", str(REFERENCE_WORKERS), "--devices", str(devices), *more]
    return cli(*args, env={"ELASTICD_TEST_WORKERS": str(REFERENCE_WORKERS), **SMALL_BUCKETS, **(env or {})},
               timeout=RUN_TIMEOUT)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("job", EQUIVALENCE_JOBS)
def test_reference_trains(job: str, ddp_reference: Callable[[str], Reference]) -> None:
    """Guard against a vacuous comparison: under DDP every float tensor moves well beyond the tolerance."""
    ref = ddp_reference(job)
    assert set(ref.initial) == set(ref.final)
    unmoved = {name: rel_diff(ref.final[name], ref.initial[name]) for name in ref.final
               if ref.final[name].is_floating_point()
               and rel_diff(ref.final[name], ref.initial[name]) <= MOVED}
    assert not unmoved, f"{job}: tensors that barely changed in training: {unmoved}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("devices", [1, 2, 4])
@pytest.mark.parametrize("job", EQUIVALENCE_JOBS)
def test_ddp_equivalence(job: str, devices: int, ddp_reference: Callable[[str], Reference], tmp_path: Path) -> None:
    ref = ddp_reference(job)
    out = tmp_path / "final.pt"
    run = elasticd_run(JOBS / f"{job}.py", devices, env={"ELASTICD_TEST_OUT": str(out)})
    assert run.code == 0, f"elasticd run exited {run.code}:\n{run.output}"
    assert out.exists(), f"logical rank 0 wrote no result:\n{run.output}"
    diffs = rel_diffs(ref.final, load_state(out))
    print(f"{job} N={REFERENCE_WORKERS} M={devices}: max rel diff {max(diffs.values()):.3g} "
          f"({run.seconds:.1f}s)")
    too_far = {name: d for name, d in diffs.items() if d > TOLERANCE}
    assert not too_far, f"{job} on {devices} devices differs from DDP (max|Δ|/max|p| per tensor): {too_far}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("job", ["mlp_sgd", "tiny_lm"])
def test_ddp_equivalence_across_emulated_islands_resized_live(job: str, ddp_reference: Callable[[str], Reference],
                                                              tmp_path: Path) -> None:
    """Default mode on 4 devices in two islands of two (agent/comm/islands.py: every all-reduce, the 1 KiB
    gradient buckets' included, goes to the island's leader, between leaders, and back), shrunk live to 3
    (islands of 2 and 1) and grown back to 4: DDP's result within the same round-off."""
    ref = ddp_reference(job)
    out = tmp_path / "final.pt"
    run = elasticd_run(JOBS / f"{job}.py", 4, {"ELASTICD_TEST_OUT": str(out), "ELASTICD_ISLANDS": "2"},
                       "--scale-at", "3:3,6:4")
    assert run.code == 0, f"elasticd run exited {run.code}:\n{run.output}"
    assert "resized 4 -> 3 devices after step 3" in run.output and "resized 3 -> 4 devices after step 6" in run.output, \
        run.output
    diffs = rel_diffs(ref.final, load_state(out))
    too_far = {name: d for name, d in diffs.items() if d > TOLERANCE}
    assert not too_far, f"{job} across islands differs from DDP (max|Δ|/max|p| per tensor): {too_far}"


FAILURE_MESSAGE = "deliberate failure on logical rank 2 at step 3"  # raised by tests/jobs/raises.py


def _names_rank(output: str, rank: int) -> bool:
    """The runner names the rank itself: the exception's own message (which says it too) doesn't count."""
    return re.search(rf"\brank\W{{0,3}}{rank}\b", output.replace(FAILURE_MESSAGE, "")) is not None


@pytest.mark.timeout(300)
@pytest.mark.parametrize("devices", [1, 2])
def test_raising_worker_stops_the_run(devices: int) -> None:
    run = elasticd_run(JOBS / "raises.py", devices, env={SHARED_DIR_VAR: ""})   # its agents in its session
    assert run.code != 0, f"a raising worker must fail the run:\n{run.output}"
    assert run.seconds < FAILURE_DEADLINE, f"took {run.seconds:.0f}s to notice the failure"
    assert "Traceback" in run.output and "raise DeliberateFailure" in run.output, run.output
    assert FAILURE_MESSAGE in run.output, run.output
    assert _names_rank(run.output, 2), f"the failing logical rank is not named:\n{run.output}"
    # Nothing the run started (agents) may outlive it.
    wait_until(lambda: not session_pids(run.session), 30, what="the run's agent processes to exit")


@pytest.mark.timeout(300)
def test_reference_stops_on_a_raising_rank(capfd: pytest.CaptureFixture[str]) -> None:
    """The harness itself: a raising rank fails the DDP reference promptly instead of hanging its peers."""
    code = run_native_ddp(str(JOBS / "raises.py"), None, REFERENCE_WORKERS,
                          env={"ELASTICD_TEST_WORKERS": str(REFERENCE_WORKERS)}, timeout=FAILURE_DEADLINE)
    err = capfd.readouterr().err
    assert code not in (0, 124), f"exit code {code}:\n{err}"
    assert "rank 2 failed" in err and "raise DeliberateFailure" in err, err
