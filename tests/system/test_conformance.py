"""The conformance matrix: the module families people train, Hugging Face models built from configs, the
common optimizers and schedulers (tests/jobs/_matrix_models.py), each trained by 4 logical workers and
compared with real `DistributedDataParallel` over 4 gloo processes.

Each family runs under DDP once, then under elasticd on 1 device, on 2, and on 2 resized live to 1 and back
(`--scale-at 3:1,6:2`). Every model must (a) have trained: its parameters moved from their initial values by
far more than the tolerance, and (b) match DDP per model in two ways: the global relative difference
||elasticd - DDP|| / ||DDP|| over all its tensors, and the largest elementwise difference relative to its
largest value. A per-tensor relative figure would measure noise: a tensor whose gradient is zero but for
round-off (an attention key bias, a bias right before BatchNorm) moves by round-off-driven amounts under
Adam-like optimizers whatever the summation order, DDP's own included, so the matrix trains such models
with SGD and builds the rest without such biases (_matrix_models.py says which).

Deterministic mode is bitwise the same on every M and across the resize for two families, and the issue's own
job (a TransformerEncoder LM with AdamW, LambdaLR and ctx.clip_grad_norm_) is resized through a daemon.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import pytest
import torch
from cluster import status, wait_state
from util import JOBS, REFERENCE_WORKERS, cli, element_diff, global_diff, load_state, wait_until

JOB = str(JOBS / "matrix_job.py")
RUNS = {"one": ("--devices", "1"), "two": ("--devices", "2"), "resized": ("--devices", "2", "--scale-at", "3:1,6:2")}
GLOBAL_TOLERANCE = 1e-6     # measured: at most 5e-7 (a bidirectional GRU under centered RMSprop), most ~1e-8
ELEMENT_TOLERANCE = 5e-5    # of the model's largest value; measured at most 9e-6
MOVED = 1e-4                # every model moves at least this far from its start (global relative)
# Cases whose fp32 result depends on the order four ranks' gradients are summed in, or on the number of
# threads a CPU kernel splits its reduction over, beyond GLOBAL_TOLERANCE, on some CPUs: RMSprop divides by
# running gradient magnitudes, and ReLU6/Hardswish/Hardsigmoid gate on thresholds, so a last-bit difference
# in a near-zero gradient grows (on one machine kind: 1.4e-5 global, 8e-5 in one element, after 8 steps; on
# another, a 1-device agent's 2 threads against the DDP ranks' 1: 8.6e-6 global). Each is compared within
# 2x of what the order and the thread count alone move it on this machine (`roundoff_tolerance`), which
# must be nothing in fp64: round-off, not a difference of semantics. (case -> its family)
ROUNDOFF_CASES = {"mobilenet_inverted_residual": "conv"}


def run(tmp: Path, name: str, family: str, *args: str, **env: str) -> dict[str, torch.Tensor]:
    out = tmp / f"{family}.{name}.pt"
    r = cli("run", JOB, "--workers", str(REFERENCE_WORKERS), *args, timeout=400,
            env={"ELASTICD_MATRIX_FAMILY": family, "ELASTICD_TEST_OUT": str(out), **env})
    assert r.code == 0, f"{family} ({name}) failed:\n{r.output[-4000:]}"
    if "--scale-at" in args:
        assert "resized 2 -> 1 devices" in r.output and "resized 1 -> 2 devices" in r.output, r.output[-3000:]
    return load_state(out)


def by_model(state: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    """Keys by model: `{case}.{key}`, and a case's EMA teacher as `{case}.teacher`."""
    out: dict[str, list[str]] = {}
    for k in state:
        case, rest = k.split(".", 1)
        out.setdefault(f"{case}.teacher" if rest.startswith("teacher.") else case, []).append(k)
    return out


@pytest.fixture(scope="module")
def ddp(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, torch.Tensor], dict]]:
    """Per family, DDP's final state and the models' initial state (computed once per test process)."""
    return {}


def reference(ddp: dict, tmp: Path, family: str) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    if family not in ddp:
        init = tmp / f"{family}.init.pt"
        final = run(tmp, "ddp", family, "--ddp", ELASTICD_TEST_INIT=str(init))
        ddp[family] = (final, load_state(init))
    return ddp[family]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["attention", "recurrent", "conv", "norms", "structure",
                                    pytest.param("hf", marks=pytest.mark.slow), "lm"])
def test_every_model_of_the_family_trains_and_resizes_as_under_ddp(tmp_path: Path, ddp: dict, family: str) -> None:
    want, init = reference(ddp, tmp_path, family)
    models = by_model(want)
    for model, keys in models.items():
        if not model.endswith(".teacher"):
            moved = global_diff(want, init, [k for k in keys if k in init])
            assert moved > MOVED, f"{model} barely trained under DDP ({moved:.1e}): the comparison would prove nothing"
    failures = []
    for name, args in RUNS.items():
        got = run(tmp_path, name, family, *args)
        assert got.keys() == want.keys(), set(got) ^ set(want)
        for model, keys in models.items():
            g, e = global_diff(want, got, keys), element_diff(want, got, keys)
            tolerance = roundoff_tolerance(model) if model in ROUNDOFF_CASES else GLOBAL_TOLERANCE
            if g > tolerance or e > ELEMENT_TOLERANCE:
                worst = max(keys, key=lambda k: float((want[k].double() - got[k].double()).abs().max())
                            if want[k].numel() else 0.0)
                failures.append(f"{name}: {model} differs from DDP: global {g:.1e}, elementwise {e:.1e} "
                                f"(worst {worst})")
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", ["attention", "conv"])
def test_deterministic_mode_is_bitwise_the_same_on_every_m_and_across_resizes(tmp_path: Path, family: str) -> None:
    runs = {name: run(tmp_path, name, family, *args, ELASTICD_TEST_DETERMINISTIC="1")
            for name, args in RUNS.items()}
    one = runs.pop("one")
    for name, got in runs.items():
        differ = [k for k in one if not torch.equal(one[k], got[k])]
        assert not differ, f"{name} is not bitwise the 1-device run: {differ[:5]}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_transformer_encoder_lm_resized_through_the_daemon_matches_ddp(cluster, tmp_path: Path) -> None:
    """The job of the report: nn.TransformerEncoder, AdamW, LambdaLR passed to ctx.replicate,
    ctx.clip_grad_norm_; `elasticd scale` 2 -> 1 -> 2 while it trains."""
    steps = {"ELASTICD_MATRIX_STEPS": "16"}
    want = run(tmp_path, "ddp", "lm", "--ddp", **steps)
    sd = cluster.daemon(cpu=2, fake=False).state_dir
    out, release = tmp_path / "daemon.pt", tmp_path / "release"
    env = {"ELASTICD_MATRIX_FAMILY": "lm", "ELASTICD_TEST_OUT": str(out), "ELASTICD_TEST_RELEASE": str(release),
           "ELASTICD_TEST_PACE_S": "1.0", **steps}
    r = cli("submit", JOB, "--workers", str(REFERENCE_WORKERS), "--state-dir", str(sd),
            *[x for k, v in env.items() for x in ("--env", f"{k}={v}")])
    assert r.code == 0, r.output
    job = r.out.strip()
    wait_state(sd, job, "running", timeout=120)
    wait_until(lambda: status(sd, job)["jobs"][0]["step"] >= 2, 60, what="training to start")
    for n, devices in enumerate((1, 2), start=1):
        r = cli("scale", job, "--devices", str(devices), "--state-dir", str(sd))
        assert r.code == 0, r.output

        def resized(n: int = n) -> dict | None:
            info = status(sd, job)["jobs"][0]
            assert info["state"] not in ("failed", "finished", "stopped"), info
            return info if len(info["resizes"]) >= n and info["resizing"] is None else None
        info = wait_until(resized, 120, interval=0.1, what=f"resize #{n}")
        assert info["resizes"][-1]["outcome"] == "done" and info["devices"] == devices, info["resizes"]
        # A grow takes the device a shrink's leaver held only once that agent has exited (the scheduler
        # refuses it until then, saying so).
        wait_until(lambda d=devices: len(status(sd)["nodes"][0]["free"]) == 2 - d, 60, what="the leaver's device")
    release.touch()
    wait_state(sd, job, "finished", timeout=180)
    got = load_state(out)
    keys = list(want)
    assert got.keys() == want.keys()
    assert global_diff(want, got, keys) <= GLOBAL_TOLERANCE and element_diff(want, got, keys) <= ELEMENT_TOLERANCE


def _train_summing_in_order(case_name: str, family: str, pairwise: bool, dtype: torch.dtype,
                            threads: int = 1) -> dict[str, torch.Tensor]:
    """matrix_job.py's training of one case in one process, its kernels on `threads` threads: the four
    ranks' gradients computed apart and averaged, summed one after another or pairwise, then clipped and
    stepped, as DDP and elasticd do."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _train(case_name, family, pairwise, dtype)
    finally:
        torch.set_num_threads(before)


def _train(case_name: str, family: str, pairwise: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    import _matrix_models as mm

    cases = mm.FAMILIES[family]
    i = [c.name for c in cases].index(case_name)
    torch.manual_seed(0)
    model = [c.build() for c in cases][i].to(dtype)
    case = cases[i]
    opt = case.optimizer(list(model.parameters()))
    for step in range(mm.STEPS):
        grads = []
        for rank in range(REFERENCE_WORKERS):
            g = torch.Generator().manual_seed((step * 64 + rank) * 32 + i)
            batch = tuple(t.to(dtype) if t.is_floating_point() else t for t in case.batch(g))
            model.zero_grad()
            case.loss(model, batch).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for j, p in enumerate(model.parameters()):
            a, b, c, d = (r[j] for r in grads)
            p.grad = ((a + b) + (c + d) if pairwise else ((a + b) + c) + d) / REFERENCE_WORKERS
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return {k: v.double() for k, v in model.state_dict().items() if v.is_floating_point()}


@functools.cache
def _order_sensitivity(case_name: str) -> tuple[float, float]:
    """How far summing the same gradients in another order, or computing them on as many threads as an agent
    of a 1-device run uses, moves the case: (fp32, fp64), global relative, the larger of the two."""
    if str(JOBS) not in sys.path:
        sys.path.insert(0, str(JOBS))
    family = ROUNDOFF_CASES[case_name]
    many = os.cpu_count() or 1   # agent/process.py `_set_threads`: the node's cores over the agents

    def moved(dtype: torch.dtype) -> float:
        base = _train_summing_in_order(case_name, family, False, dtype)
        others = [_train_summing_in_order(case_name, family, True, dtype),
                  _train_summing_in_order(case_name, family, False, dtype, threads=many)]
        return max(global_diff(base, other, list(base)) for other in others)

    return moved(torch.float32), moved(torch.float64)


def roundoff_tolerance(case_name: str) -> float:
    fp32, fp64 = _order_sensitivity(case_name)
    assert fp64 < 1e-12, f"{case_name} depends on the summation order or threads even in fp64 ({fp64:.1e}): not round-off"
    return max(GLOBAL_TOLERANCE, 2 * fp32)


@pytest.mark.parametrize("case_name", sorted(ROUNDOFF_CASES))
def test_a_roundoff_tolerance_is_the_case_s_own_sensitivity_to_summation_order_and_threads(case_name: str) -> None:
    fp32, fp64 = _order_sensitivity(case_name)
    print(f"{case_name}: summation order and thread count move it {fp32:.1e} in fp32, {fp64:.1e} in fp64")
    assert fp64 < 1e-12, "not round-off: the case depends on the order or the threads even in fp64"
    assert roundoff_tolerance(case_name) <= max(GLOBAL_TOLERANCE, 1e-4)
