"""What each backward pass costs the runtime: default mode keeps the gradient books once per backward pass
instead of in per-parameter hooks, and keeps them right when a pass raises."""

from __future__ import annotations

import torch

import elasticd


class _FailOnce(torch.autograd.Function):
    """Identity whose backward raises the first time it runs: a backward pass that fails midway."""

    armed = True

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if _FailOnce.armed:
            _FailOnce.armed = False
            raise RuntimeError("transient failure in backward")
        return g


def _reference(workers: int, steps: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        opt.zero_grad()
        for r in range(workers):
            x = torch.full((2, 4), float(r + step + 1))
            (model(x).sum() / workers).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def test_default_mode_books_without_hooks_and_survives_a_caught_backward_error() -> None:
    """Two hosted workers, default mode: no per-parameter hook stays registered, and a backward pass that
    raises (caught by the worker, which retries) leaves the books right: the parameters are those of the
    plain averaged loop. With the pass left open, the retry would count as nested and never be averaged."""
    got: dict[int, list[torch.Tensor]] = {}
    hooks: list[int] = []
    _FailOnce.armed = True

    @elasticd.elastic(workers=2)
    def train(ctx):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = ctx.replicate(model, opt)
        for step in ctx.steps(3):
            opt.zero_grad()
            x = torch.full((2, 4), float(ctx.rank + step + 1))
            if ctx.rank == 1 and step == 1:
                try:
                    _FailOnce.apply(model(x).sum()).backward()
                except RuntimeError:
                    pass
            model(x).sum().backward()
            opt.step()
        group = ctx._rt.groups[0]
        hooks.append(len(group._pre_handles) + len(group._post_handles))
        got[ctx.rank] = [p.detach().clone() for p in model.parameters()]

    train()
    assert _FailOnce.armed is False, "the failing pass did not run"
    assert hooks == [0, 0]
    for a, b in zip(got[0], _reference(2, 3), strict=True):
        torch.testing.assert_close(a, b)
