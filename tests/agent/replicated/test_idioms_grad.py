"""Gradient-side idioms on replicated state: N=4 on M=1, 2 devices vs real DDP.

Hosted workers share one `.grad` per replicated parameter. Idioms that are valid under DDP, where each
rank owns its `.grad`, must give DDP's result (`model.zero_grad()`, a submodule's `zero_grad()` and
`p.grad = None` loops, several backward passes per step without `no_sync`, also across a live resize and,
in deterministic mode, bitwise equal for every M); other changes of replicated gradients or parameters by
worker code must stop the run with an error naming them (agent/replicated/ledger.py), never exit 0.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from util import JOBS, REFERENCE_WORKERS, CliResult, Reference, cli, load_state, rel_diffs

TOLERANCE = 1e-5  # DDP tolerance: local pre-summation reorders fp32 additions, nothing more
RUN_TIMEOUT = 300.0


def elasticd_run(job: str, devices: int, out: Path | None = None, extra: list[str] | None = None,
                 env: dict[str, str] | None = None) -> CliResult:
    args = ["run", str(JOBS / f"{job}.py"), "--workers", str(REFERENCE_WORKERS), "--devices", str(devices),
            *(extra or [])]
    # 1 KiB gradient buckets: the flush overlapped with backward (agent/replicated/buckets.py), as in
    # tests/system/test_equivalence.py, meets every idiom the ledger judges.
    env = {"ELASTICD_TEST_WORKERS": str(REFERENCE_WORKERS), "ELASTICD_BUCKET_KB": "1", **(env or {})}
    if out is not None:
        env["ELASTICD_TEST_OUT"] = str(out)
    return cli(*args, env=env, timeout=RUN_TIMEOUT)


def assert_like_ddp(job: str, ref: Reference, run: CliResult, out: Path, what: str) -> None:
    assert run.code == 0, f"{what}: elasticd run exited {run.code}:\n{run.output}"
    diffs = rel_diffs(ref.final, load_state(out))
    moved = min(rel_diffs(ref.initial, ref.final).values())
    print(f"{job} {what}: max rel diff vs DDP {max(diffs.values()):.3g} (DDP moved >= {moved:.3g})")
    assert moved > 100 * TOLERANCE, f"{job}: the reference barely trained, the comparison would be vacuous"
    too_far = {name: d for name, d in diffs.items() if d > TOLERANCE}
    assert not too_far, f"{job} {what} differs from DDP (max|Δ|/max|p| per tensor): {too_far}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("job", ["zero_model", "zero_parts", "zero_data", "accum_sync"])
def test_idiom_gives_ddps_result(job: str, devices: int, ddp_reference: Callable[[str], Reference],
                                 tmp_path: Path) -> None:
    ref = ddp_reference(job)
    out = tmp_path / "final.pt"
    assert_like_ddp(job, ref, elasticd_run(job, devices, out), out, f"N=4 M={devices}")


@pytest.mark.timeout(900)
def test_accumulation_without_no_sync_across_a_resize(ddp_reference: Callable[[str], Reference],
                                                      tmp_path: Path) -> None:
    """Shrunk 2 -> 1 after step 6: the shared gradients and the ledger start over on the new agent."""
    ref = ddp_reference("accum_sync")
    out = tmp_path / "final.pt"
    summary = tmp_path / "summary.json"
    run = elasticd_run("accum_sync", 2, out, extra=["--scale-at", "6:1", "--summary", str(summary)])
    assert_like_ddp("accum_sync", ref, run, out, "N=4 M=2 -> 1 at step 6")
    resizes = json.loads(summary.read_text())["resizes"]
    assert [(r["from"], r["to"]) for r in resizes] == [(2, 1)], resizes


@pytest.mark.timeout(900)
def test_accumulation_without_no_sync_is_bitwise_equal_for_every_m_in_deterministic_mode(tmp_path: Path) -> None:
    results = {}
    for m in (1, 2, 4):
        out = tmp_path / f"m{m}.pt"
        run = elasticd_run("accum_sync", m, out, env={"ELASTICD_TEST_DETERMINISTIC": "1"})
        assert run.code == 0, f"M={m}: exit {run.code}:\n{run.output}"
        results[m] = load_state(out)
    for m in (2, 4):
        for name, want in results[1].items():
            assert torch.equal(want, results[m][name]), f"{name}: M={m} differs from M=1 in deterministic mode"


REFUSED = {
    "grad_mul": "changed the gradient of replicated parameter",
    "grad_zero": "changed the gradient of replicated parameter",
    "grad_data_partial": "changed the gradient of replicated parameter",
    "param_mul": "changed replicated parameter",
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("idiom", sorted(REFUSED))
def test_other_changes_of_replicated_state_are_refused(idiom: str) -> None:
    """On every M, also M=N: a job must not pass at one size and fail after a resize to another."""
    for devices in (1, 4):
        run = elasticd_run("grad_refused", devices, env={"ELASTICD_TEST_IDIOM": idiom})
        assert run.code != 0, f"{idiom} on {devices} devices exited 0:\n{run.output}"
        assert "ReplicatedStateError" in run.output and REFUSED[idiom] in run.output, run.output


@pytest.mark.timeout(900)
@pytest.mark.parametrize("devices", [1, 2])
def test_references_taken_before_replicate_train_the_shared_model(devices: int,
                                                                   ddp_reference: Callable[[str], Reference],
                                                                   tmp_path: Path) -> None:
    """tests/jobs/held_refs.py: a submodule held for an auxiliary loss and a head held for logging."""
    ref = ddp_reference("held_refs")
    out = tmp_path / "final.pt"
    assert_like_ddp("held_refs", ref, elasticd_run("held_refs", devices, out), out, f"N=4 M={devices}")


@pytest.mark.timeout(300)
def test_a_gradient_into_a_parameter_held_from_before_replicate_is_refused(tmp_path: Path) -> None:
    run = elasticd_run("held_refs", 1, tmp_path / "final.pt", env={"ELASTICD_TEST_PENALTY": "1"})
    assert run.code != 0, run.output
    assert "logical rank 1's backward accumulated a gradient into parameter '4.bias' as it was before ctx.replicate" \
        in run.output, run.output   # rank 0's model is the shared copy; the last layer's gradient comes first
    assert not (tmp_path / "final.pt").exists()
