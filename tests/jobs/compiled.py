"""A job whose replicated model is compiled (`torch.compile`, inductor by default) after `ctx.replicate`,
as a user adding one line would; deterministic mode. Rank 0 saves the final parameters to
$ELASTICD_TEST_OUT. Env: ELASTICD_TEST_BACKEND (torch.compile's backend, default inductor), ELASTICD_TEST_BN=1
(a BatchNorm after the first layer: buffers, which the replicated model's forward hooks guard)."""

import os

import torch

import elasticd

WORKERS, STEPS, BATCH = 4, 20, 8


@elasticd.elastic(workers=WORKERS, deterministic=True)
def train(ctx):
    torch.manual_seed(0)
    norm = [torch.nn.BatchNorm1d(64)] if os.environ.get("ELASTICD_TEST_BN") else []
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), *norm, torch.nn.GELU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, opt = ctx.replicate(model, opt)
    compiled = torch.compile(model, backend=os.environ.get("ELASTICD_TEST_BACKEND", "inductor"))
    g = torch.Generator().manual_seed(1)
    data = torch.randn(WORKERS * BATCH * STEPS, 32, generator=g)
    target = torch.randn(WORKERS * BATCH * STEPS, 4, generator=g)
    for step in ctx.steps(STEPS):
        lo = (step * WORKERS + ctx.rank) * BATCH
        loss = torch.nn.functional.mse_loss(compiled(data[lo:lo + BATCH]), target[lo:lo + BATCH])
        opt.zero_grad()
        loss.backward()
        opt.step()
    if ctx.rank == 0:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.environ["ELASTICD_TEST_OUT"])


if __name__ == "__main__":
    train()
