"""The conformance matrix's job: every model of one family (ELASTICD_MATRIX_FAMILY, tests/jobs/_matrix_models.py)
trained side by side, each under its own `ctx.replicate` with its own optimizer and scheduler.

The loop is what users write: one backward of the summed loss, `torch.nn.utils.clip_grad_norm_` on each model
(`ctx.clip_grad_norm_` when the family has one model), `opt.step()`, then the scheduler (ReduceLROnPlateau on
the loss averaged over every rank, as a DDP script must give it). Schedulers are passed to `ctx.replicate` or
left for elasticd to find, as each case says. Each rank draws its batch from its own seeded generator, so data
needs no loader; dropout draws from each rank's own global stream. Logical rank 0 writes every model's state
as `{case.name}.{key}` to ELASTICD_TEST_OUT (and before training to
ELASTICD_TEST_INIT), with each model's loss on a fixed batch in eval mode under no_grad after training. With ELASTICD_TEST_RELEASE set, each step waits for that file to
exist (up to ELASTICD_TEST_PACE_S), so that a test can resize the job through the daemon while it trains.
"""

from __future__ import annotations

import os
import time

import torch
from _matrix_models import FAMILIES, STEPS

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
FAMILY = os.environ.get("ELASTICD_MATRIX_FAMILY", "lm")
DETERMINISTIC = os.environ.get("ELASTICD_TEST_DETERMINISTIC") == "1"


def pace() -> None:
    release = os.environ.get("ELASTICD_TEST_RELEASE")
    deadline = time.monotonic() + float(os.environ.get("ELASTICD_TEST_PACE_S", "0.5"))
    while release and not os.path.exists(release) and time.monotonic() < deadline:
        time.sleep(0.01)


@elasticd.elastic(workers=WORKERS, deterministic=DETERMINISTIC)
def train(ctx) -> None:
    cases = FAMILIES[FAMILY]
    torch.manual_seed(0)
    models = [case.build().to(ctx.device) for case in cases]
    if ctx.rank == 0:
        save(cases, models, "ELASTICD_TEST_INIT")
    torch.manual_seed(100 + ctx.rank)  # each rank's own dropout masks
    teachers = {}
    for case, model in zip(cases, models, strict=True):
        if case.ema_teacher:   # DINO's way: a second network loading the student's weights, not a deepcopy
            teachers[case.name] = case.build().to(ctx.device).requires_grad_(False)
            teachers[case.name].load_state_dict(model.state_dict())
    trained = []
    for case, model in zip(cases, models, strict=True):
        opt = case.optimizer([p for p in model.parameters() if p.requires_grad])
        sched = case.scheduler(opt) if case.scheduler is not None else None
        if sched is not None and case.register_scheduler:
            model, opt, sched = ctx.replicate(model, opt, lr_scheduler=sched)
        else:
            model, opt = ctx.replicate(model, opt)
        trained.append((case, model, opt, sched))
    for step in ctx.steps(STEPS):
        losses = []
        for i, (case, model, _, _) in enumerate(trained):
            g = torch.Generator().manual_seed((step * 64 + ctx.rank) * 32 + i)
            batch = tuple(t.to(ctx.device) for t in case.batch(g))
            losses.append(case.loss(model, batch))
        loss = torch.stack(losses).sum()
        for _, _, opt, _ in trained:
            opt.zero_grad()
        loss.backward()
        mean = loss.detach().clone()
        ctx.all_reduce(mean)
        for case, model, opt, sched in trained:
            if len(trained) == 1:
                ctx.clip_grad_norm_(1.0)
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if sched is not None:
                sched.step(mean.item() / ctx.world_size) if case.plateau else sched.step()
            if case.name in teachers:
                with torch.no_grad():
                    for t, s in zip(teachers[case.name].parameters(), model.parameters(), strict=True):
                        t.mul_(0.9).add_(s.detach(), alpha=0.1)
        ctx.log(loss=loss.item())
        pace()
    evals = {}
    for case, model, _, _ in trained:   # eval mode, no grad: the inference paths (nested tensors)
        model.eval()
        with torch.no_grad():
            batch = tuple(t.to(ctx.device) for t in case.batch(torch.Generator().manual_seed(999)))
            evals[f"{case.name}.eval_loss"] = (case.evaluate or case.loss)(model, batch).detach()
    if ctx.rank == 0:
        save(cases, [model for _, model, _, _ in trained], "ELASTICD_TEST_OUT",
             {f"{name}.teacher": t for name, t in teachers.items()}, evals)


def save(cases: list, models: list[torch.nn.Module], env: str, more: dict | None = None,
         tensors: dict[str, torch.Tensor] | None = None) -> None:
    path = os.environ.get(env)
    if path:
        named = {**{case.name: model for case, model in zip(cases, models, strict=True)}, **(more or {})}
        state = {f"{name}.{k.removeprefix('module.')}": v.detach().cpu().clone()
                 for name, model in named.items() for k, v in _state(model).items()}
        torch.save({**state, **{k: v.cpu() for k, v in (tensors or {}).items()}}, path)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """state_dict() and the buffers it leaves out (persistent=False)."""
    return {**dict(model.named_buffers()), **model.state_dict()}


if __name__ == "__main__":
    train()
