"""Model averages and random generators the function keeps in its own variables survive live resizes.

DDP scripts keep an EMA of their model per process (torch's `AveragedModel`, or a `copy.deepcopy` of the
model updated by hand) and seed generators of their own. A resize re-enters the function, which builds
them again: before they were carried, a 2 -> 1 -> 2 run ended with exit 0 and an average ~1e-2 away from
DDP's (tests/jobs/ema_job.py keeps a short memory so that a restarted average shows), and a model 0.2 away
when its batches came from its own generators. Real agents over gloo against real DDP (`elasticd run
--ddp`), and bitwise against the unscaled run in deterministic mode.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from util import JOBS, REFERENCE_WORKERS, CliResult, cli, load_state, rel_diffs

TOLERANCE = 1e-5  # as tests/system/test_equivalence.py: fp32 reordering of the gradient sum, nothing more


def _run(out: Path, variant: str, *args: str, deterministic: bool = False) -> CliResult:
    env = {"ELASTICD_TEST_WORKERS": str(REFERENCE_WORKERS), "ELASTICD_TEST_OUT": str(out),
           "ELASTICD_TEST_EMA": variant, "ELASTICD_TEST_DETERMINISTIC": "1" if deterministic else "0"}
    run = cli("run", str(JOBS / "ema_job.py"), "--workers", str(REFERENCE_WORKERS), *args, env=env, timeout=400)
    assert run.code == 0, run.output
    return run


@pytest.mark.timeout(900)
@pytest.mark.parametrize("variant", [pytest.param("averaged", marks=pytest.mark.slow), "copy", "module", "tensors"])
def test_a_model_average_never_registered_survives_resizes_as_under_ddp(variant: str, tmp_path: Path) -> None:
    _run(tmp_path / "ddp.pt", variant, "--ddp")
    run = _run(tmp_path / "scaled.pt", variant, "--devices", "2", "--scale-at", "5:1,10:2")
    assert "resized 2 -> 1 devices" in run.output and "resized 1 -> 2 devices" in run.output, run.output
    want, got = load_state(tmp_path / "ddp.pt"), load_state(tmp_path / "scaled.pt")
    averages = [k for k in want if k.startswith("ema.")]
    assert averages, "the job saved no average"
    if variant == "averaged":
        assert got["ema.n_averaged"] == want["ema.n_averaged"] == 20, "AveragedModel's count restarted"
    # The average must be more than the model itself, or equality would prove nothing about carrying it.
    apart = rel_diffs({k: want[k] for k in averages if k != "ema.n_averaged"},
                      {k: want[k.removeprefix("ema.")] for k in averages if k != "ema.n_averaged"})
    assert max(apart.values()) > 100 * TOLERANCE, apart
    too_far = {k: d for k, d in rel_diffs(want, got).items() if d > TOLERANCE}
    assert not too_far, f"the {variant} average (or the model) differs from DDP after the resizes: {too_far}"


@pytest.mark.timeout(900)
def test_a_model_average_is_bitwise_the_unscaled_run_in_deterministic_mode(tmp_path: Path) -> None:
    _run(tmp_path / "unscaled.pt", "averaged", "--devices", "2", deterministic=True)
    _run(tmp_path / "scaled.pt", "averaged", "--devices", "2", "--scale-at", "5:1,10:2", deterministic=True)
    want, got = load_state(tmp_path / "unscaled.pt"), load_state(tmp_path / "scaled.pt")
    assert want.keys() == got.keys()
    differ = [k for k in want if not torch.equal(want[k], got[k])]
    assert not differ, f"not bitwise the unscaled run: {differ}"


def test_deep_copies_outside_workers_are_plain_copies() -> None:
    """elasticd gives nn.Module a __deepcopy__ (to see a worker's copies): elsewhere it must be deepcopy's own."""
    from elasticd.agent.capture import carried

    carried.install()
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    model.tag = [1, 2]
    twin = copy.deepcopy({"m": model, "again": model})
    assert twin["m"] is twin["again"] and twin["m"] is not model and twin["m"].tag == [1, 2]
    assert twin["m"].tag is not model.tag
    for (name, a), (_, b) in zip(model.state_dict().items(), twin["m"].state_dict().items(), strict=True):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr(), name


@pytest.mark.timeout(900)
def test_generators_and_counters_in_the_functions_variables_go_on_across_resizes(tmp_path: Path) -> None:
    """torch, numpy (new and legacy) and `random` generators a rank seeds itself, and the plain values its loop
    changes: an iteration counter setting the LR, a loss history, a best loss; and a hand-written loader object's
shard, position and rows (tests/jobs/function_locals.py)."""
    env = {"ELASTICD_TEST_WORKERS": str(REFERENCE_WORKERS)}
    args = ["run", str(JOBS / "function_locals.py"), "--workers", str(REFERENCE_WORKERS)]
    ddp = cli(*args, "--ddp", env={**env, "ELASTICD_TEST_OUT": str(tmp_path / "ddp.pt")}, timeout=400)
    assert ddp.code == 0, ddp.output
    scaled = cli(*args, "--devices", "2", "--scale-at", "5:1,10:2",
                 env={**env, "ELASTICD_TEST_OUT": str(tmp_path / "scaled.pt")}, timeout=400)
    assert scaled.code == 0, scaled.output
    assert "resized 1 -> 2 devices" in scaled.output, scaled.output
    diffs = rel_diffs(load_state(tmp_path / "ddp.pt"), load_state(tmp_path / "scaled.pt"))
    too_far = {k: d for k, d in diffs.items() if d > TOLERANCE}
    assert not too_far, f"a generator or a variable started over at a resize: {too_far}"


def ddp_then_elasticd(tmp_path: Path, job: str) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """Rank 0's saved state of `job` under `--ddp`, then under elasticd on 2 devices resized 2 -> 1 -> 2
    ("scaled") and on 1 ("one"); every run must exit 0."""
    env = {"ELASTICD_TEST_WORKERS": str(REFERENCE_WORKERS)}
    runs = {"ddp": ("--ddp",), "scaled": ("--devices", "2", "--scale-at", "3:1,6:2"), "one": ("--devices", "1")}
    states = {}
    for name, args in runs.items():
        run = cli("run", str(JOBS / job), "--workers", str(REFERENCE_WORKERS), *args,
                  env={**env, "ELASTICD_TEST_OUT": str(tmp_path / f"{name}.pt")}, timeout=400)
        assert run.code == 0, run.output
        states[name] = load_state(tmp_path / f"{name}.pt")
    want = states.pop("ddp")
    return want, states


def assert_ddp_close(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor], name: str) -> None:
    too_far = {k: d for k, d in rel_diffs(want, got).items() if d > TOLERANCE}
    assert not too_far, f"{name}: differs from DDP: {too_far}"


@pytest.mark.timeout(900)
def test_a_training_state_dict_an_l2sp_anchor_and_the_best_weights_survive_resizes_as_under_ddp(tmp_path: Path) -> None:
    """tests/jobs/taken_job.py: a dict holding the model beside a hand-decayed LR, parameter copies taken before
    the loop (never changed by it) and the best weights as an OrderedDict. Each came back wrong, exit 0: the
    dict was not carried at all, the copies were taken again from the model the resize restored."""
    env = {"ELASTICD_TEST_WORKERS": str(REFERENCE_WORKERS)}
    ddp = cli("run", str(JOBS / "taken_job.py"), "--workers", str(REFERENCE_WORKERS), "--ddp",
              env={**env, "ELASTICD_TEST_OUT": str(tmp_path / "ddp.pt")}, timeout=400)
    assert ddp.code == 0, ddp.output
    run = cli("run", str(JOBS / "taken_job.py"), "--workers", str(REFERENCE_WORKERS), "--devices", "2",
              "--scale-at", "5:1,10:2", env={**env, "ELASTICD_TEST_OUT": str(tmp_path / "scaled.pt")}, timeout=400)
    assert run.code == 0, run.output
    assert "resized 2 -> 1 devices" in run.output and "resized 1 -> 2 devices" in run.output, run.output
    want, got = load_state(tmp_path / "ddp.pt"), load_state(tmp_path / "scaled.pt")
    assert want.keys() == got.keys() and "state.lr" in want and "best.0.weight" in want
    # The best weights are those of a step before the resizes, not the final ones, or this would prove nothing.
    apart = rel_diffs({k: want[f"best.{k}"] for k in ("0.weight", "2.weight")},
                      {k: want[k] for k in ("0.weight", "2.weight")})
    assert max(apart.values()) > 100 * TOLERANCE, apart
    too_far = {k: d for k, d in rel_diffs(want, got).items() if d > TOLERANCE}
    assert not too_far, f"differs from DDP after the resizes: {too_far}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("job", ["eval_mode_job.py", "ema_swap_job.py"])
def test_an_evaluation_after_a_collective_sees_its_own_mode_step_and_weights_as_under_ddp(tmp_path: Path,
                                                                                         job: str) -> None:
    """tests/jobs/eval_mode_job.py: `model.eval()`, a broadcast, then the evaluation. Without it, the later worker
    of an agent evaluated in training mode (the first had called `model.train()` since: dropout on, batch
    statistics) with running statistics its first worker's next training forward had changed; every later
    step then differed from DDP too, exit 0. tests/jobs/ema_swap_job.py: an EMA swapped in through `p.data`
    across the broadcast; the next worker trained on from the first one's EMA. On 2 devices resized to 1 and
    back, and on 1."""
    want, runs = ddp_then_elasticd(tmp_path, job)
    assert torch.equal(want["evals"], want["evals"][:1].expand_as(want["evals"])), "DDP's ranks agree"
    for name, got in runs.items():
        torch.testing.assert_close(got["evals"], want["evals"], rtol=1e-5, atol=1e-6)
        assert_ddp_close(want, got, name)


@pytest.mark.timeout(900)
def test_hand_written_updates_through_parameter_data_are_made_once_per_step_as_under_ddp(tmp_path: Path) -> None:
    """tests/jobs/param_data_job.py: a hand-written SGD step, weight decay and clamp through `p.data`. Without it,
    each hosted worker applied them to the one shared copy: 0.71 from DDP on 2 devices, exit 0."""
    want, runs = ddp_then_elasticd(tmp_path, "param_data_job.py")
    for name, got in runs.items():
        assert_ddp_close(want, got, name)


@pytest.mark.timeout(900)
def test_a_buffer_changed_outside_the_forward_is_changed_once_per_step_as_under_ddp(tmp_path: Path) -> None:
    """tests/jobs/buffer_count_job.py: `model.updates += 1` after each step, read by the forward. Without it, each
    hosted worker added 1 to the one shared buffer (exit 0)."""
    want, runs = ddp_then_elasticd(tmp_path, "buffer_count_job.py")
    assert want["updates"].item() == 9.0 and want["seen"].item() == 9.0
    for name, got in runs.items():
        assert_ddp_close(want, got, name)



@pytest.mark.timeout(900)
def test_a_gan_step_with_batchnorm_in_both_nets_trains_as_under_ddp(tmp_path: Path) -> None:
    """tests/jobs/gan_job.py: G's forward before D's step, its backward after; two forwards of a
    spectral-normalised D before a backward. Without it, G's backward failed ("modified by an inplace operation")
    on every run with more than one worker per device, the later workers' D read the power iteration's
    vectors of the wrong forward (7e-2, exit 0), and the batch iterator, made at each epoch's first step, was
    missing after each resize (UnboundLocalError)."""
    want, runs = ddp_then_elasticd(tmp_path, "gan_job.py")
    assert want["G.1.num_batches_tracked"].item() == 9
    for name, got in runs.items():
        assert_ddp_close(want, got, name)


@pytest.mark.timeout(900)
def test_batchnorm_no_forward_hook_sees_keeps_rank_0s_statistics_as_under_ddp(tmp_path: Path) -> None:
    """tests/jobs/checkpoint_bn_job.py: BatchNorm run again in a checkpointed segment's backward, and in a
    submodule the loop calls itself. Without it, every hosted worker's batches went into the shared statistics
    (0.18-0.27 from DDP, exit 0)."""
    want, runs = ddp_then_elasticd(tmp_path, "checkpoint_bn_job.py")
    assert want["block.1.num_batches_tracked"].item() == 9 * 2     # each step's forward and its recompute
    assert want["backbone.1.num_batches_tracked"].item() == 9 + 5  # and the even steps' probes
    for name, got in runs.items():
        assert_ddp_close(want, got, name)


@pytest.mark.timeout(900)
def test_a_momentum_encoder_assigned_through_data_is_updated_once_per_step_as_under_ddp(tmp_path: Path) -> None:
    """tests/jobs/moco_job.py: MoCo's frozen key encoder in the optimizer, updated by `param_k.data = ...` in
    the forward, beside collectives and buffer writes in that forward. Without it, the optimizer was refused,
    then each hosted worker made the momentum update again (1.7 from DDP, exit 0)."""
    want, runs = ddp_then_elasticd(tmp_path, "moco_job.py")
    assert want["queue_ptr"].item() == 9 * 4 * REFERENCE_WORKERS % 32   # 9 steps of 4 keys a rank
    for name, got in runs.items():
        assert_ddp_close(want, got, name)


@pytest.mark.timeout(900)
def test_a_self_distillation_teacher_its_loss_center_and_per_parameter_clipping_follow_ddp(tmp_path: Path) -> None:
    """tests/jobs/dino_job.py: DINO's step. Without it, its per-parameter clipping through `p.grad.data` was
    refused; then a resize failed loading its own snapshot (numpy floats in param_groups); then a resize
    rebuilt the teacher and the loss's center from scratch (0.98 from DDP, exit 0). Every worker also reads
    the gradient norms DDP's ranks read before clipping (the job checks, all-reducing them)."""
    want, runs = ddp_then_elasticd(tmp_path, "dino_job.py")
    assert want["clipped"].item() > 0 and want["center"].abs().max().item() > 0
    apart = rel_diffs({k: want[f"teacher.{k}"] for k in ("backbone.0.weight", "last_layer.weight")},
                      {k: want[k] for k in ("backbone.0.weight", "last_layer.weight")})
    assert min(apart.values()) > 100 * TOLERANCE, apart   # the teacher lags the student: it is its own state
    for name, got in runs.items():
        assert_ddp_close(want, got, name)


@pytest.mark.timeout(900)
def test_draws_before_the_loop_from_a_module_level_seed_are_the_same_after_a_resize(tmp_path: Path) -> None:
    """tests/jobs/preloop_draws_job.py: its dataset and initial weights are drawn before ctx.steps from the
    stream a module-level seed set. A function re-entered after a resize must start from the streams it
    first started with: drawing on from where they had got to (the staying and the new agents from different
    places) would train the ranks on different data, exit 0."""
    env = {"ELASTICD_TEST_WORKERS": str(REFERENCE_WORKERS)}
    states = {}
    for name, args in {"ddp": ("--ddp",), "scaled": ("--devices", "2", "--scale-at", "3:1,6:2")}.items():
        run = cli("run", str(JOBS / "preloop_draws_job.py"), "--workers", str(REFERENCE_WORKERS), *args,
                  env={**env, "ELASTICD_TEST_OUT": str(tmp_path / f"{name}.pt")}, timeout=400)
        assert run.code == 0, run.output
        states[name] = load_state(tmp_path / f"{name}.pt")
    assert torch.equal(states["scaled"]["data_sum"], states["ddp"]["data_sum"])
    assert_ddp_close(states["ddp"], states["scaled"], "scaled")
