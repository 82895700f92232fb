"""Hooks registered on replicated state inside the function run for their own worker's passes, as each DDP
process's hooks run for its own: tests/jobs/hooks_job.py against real DDP, resized and on one device."""

from __future__ import annotations

from pathlib import Path

import pytest
from util import JOBS, REFERENCE_WORKERS, cli, load_state, rel_diffs

TOLERANCE = 1e-5  # as tests/system/test_equivalence.py: fp32 reordering of the gradient sum


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


@pytest.mark.timeout(900)
def test_a_wrappers_hook_method_made_before_replicate_serves_each_workers_pass_as_under_ddp(tmp_path: Path) -> None:
    """tests/jobs/hook_wrapper_job.py: byol-pytorch's NetWrapper shape, its hook a method of the wrapper that
    keeps the layer's output for its forward. Without it, every later worker failed with a KeyError."""
    env = {"ELASTICD_TEST_WORKERS": str(REFERENCE_WORKERS)}
    states = {}
    for name, args in (("ddp", ("--ddp",)), ("two", ("--devices", "2")), ("one", ("--devices", "1"))):
        run = cli("run", str(JOBS / "hook_wrapper_job.py"), "--workers", str(REFERENCE_WORKERS), *args,
                  env={**env, "ELASTICD_TEST_OUT": str(tmp_path / f"{name}.pt")}, timeout=400)
        assert run.code == 0, run.output
        states[name] = load_state(tmp_path / f"{name}.pt")
    want = states.pop("ddp")
    assert want["kept"].tolist() == [6.0] * REFERENCE_WORKERS   # one output kept per forward, per rank
    for name, got in states.items():
        assert got["kept"].tolist() == want["kept"].tolist(), (name, got["kept"])
        too_far = {k: d for k, d in rel_diffs(want, got).items() if d > TOLERANCE}
        assert not too_far, f"{name}: differs from DDP: {too_far}"


def halve(module, args, output):
    return output * 0.5


def test_a_model_with_hooks_of_workers_pickles_with_its_plain_hooks() -> None:
    """Wrapped hooks must not stop `torch.save(model)` (a whole-model checkpoint) or `copy.deepcopy(model)`."""
    import copy
    import io

    import torch

    import elasticd
    from elasticd.agent.replicated.hooks import _Owned

    seen: dict[int, object] = {}

    @elasticd.elastic(workers=2)
    def train(ctx):
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU())
        model[1].register_forward_hook(halve)
        model, _ = ctx.replicate(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in ctx.steps(1):
            model(torch.ones(1, 2)).sum().backward()
        hooks = list(model[1]._forward_hooks.values())
        assert all(isinstance(h, _Owned) for h in hooks) and len(hooks) == 2   # one per worker
        copied = copy.deepcopy(model)
        assert list(copied[1]._forward_hooks.values()) == hooks
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        seen[ctx.rank] = list(torch.load(buf, weights_only=False)[1]._forward_hooks.values())

    train()
    assert seen == {0: [halve, halve], 1: [halve, halve]}


def test_hooks_of_one_model_built_outside_the_function_run_for_every_worker() -> None:
    """A model built at the script's top level is one object that every worker passes to ctx.replicate: its
    hooks (torch.nn.utils.weight_norm's recomputes the weight before each forward) are every worker's."""
    import torch

    import elasticd

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    calls: list[int] = []
    model[0].register_forward_pre_hook(lambda m, args: calls.append(1))

    @elasticd.elastic(workers=3)
    def train(ctx):
        shared, opt = ctx.replicate(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in ctx.steps(2):
            opt.zero_grad()
            shared(torch.ones(1, 2)).sum().backward()
            opt.step()

    train()
    assert len(calls) == 3 * 2, calls
