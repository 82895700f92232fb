"""Equivalence job: a tiny causal transformer LM, with a head that only odd ranks train.

Embedding, LayerNorm, dropout and AdamW; the attention has bias-free q/k/v projections because a key
bias has a mathematically zero gradient that AdamW would turn into round-off-driven O(lr) steps
(docs/architecture.md, what must hold, 1). The auxiliary head is used only on odd ranks, so on even ranks its gradient
is None and DDP (find_unused_parameters) averages it with a zero contribution.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F
from _jobstate import save_state
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import elasticd

WORKERS = int(os.environ.get("ELASTICD_TEST_WORKERS", "4"))
STEPS = 20
BATCH = 8
VOCAB, SEQ, DIM = 24, 16, 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(DIM)
        self.q = nn.Linear(DIM, DIM, bias=False)
        self.k = nn.Linear(DIM, DIM, bias=False)
        self.v = nn.Linear(DIM, DIM, bias=False)
        self.proj = nn.Linear(DIM, DIM)
        self.ln2 = nn.LayerNorm(DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        q, k, v = self.q(h), self.k(h), self.v(h)
        scores = q @ k.transpose(1, 2) / math.sqrt(DIM)
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        att = self.drop(scores.masked_fill(causal, float("-inf")).softmax(dim=-1))
        x = x + self.drop(self.proj(att @ v))
        return x + self.drop(self.mlp(self.ln2(x)))


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.drop = nn.Dropout(0.1)
        self.block = Block()
        self.ln_f = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)
        self.aux = nn.Linear(DIM, 1)  # predicts the sequence's stride; only odd ranks use it

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.ln_f(self.block(self.drop(self.tok(tokens) + self.pos(pos))))
        return self.head(h), self.aux(h.mean(dim=1)).squeeze(1)


def make_data() -> TensorDataset:
    """Arithmetic sequences mod VOCAB with a random start and stride, one token in 8 replaced by noise."""
    g = torch.Generator().manual_seed(2024)
    n = 256
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    seq = (start + stride * torch.arange(SEQ + 1)) % VOCAB
    noise = torch.rand(n, SEQ + 1, generator=g) < 0.125
    seq = torch.where(noise, torch.randint(0, VOCAB, (n, SEQ + 1), generator=g), seq)
    return TensorDataset(seq, stride.squeeze(1).float())


@elasticd.elastic(workers=WORKERS)
def train(ctx) -> None:
    torch.manual_seed(0)
    model = TinyLM().to(ctx.device)
    if ctx.rank == 0:
        save_state(model, "ELASTICD_TEST_INIT")
    torch.manual_seed(200 + ctx.rank)  # distinct dropout masks per rank
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, opt = ctx.replicate(model, opt)
    ds = make_data()
    sampler = DistributedSampler(ds, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=0)
    batches = ctx.batches(DataLoader(ds, batch_size=BATCH, sampler=sampler, num_workers=0))
    for _ in ctx.steps(STEPS):
        seq, stride = next(batches)
        seq, stride = seq.to(ctx.device), stride.to(ctx.device)
        logits, aux = model(seq[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        if ctx.rank % 2 == 1:  # even ranks leave model.aux without a gradient
            loss = loss + F.mse_loss(aux, stride)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.log(loss=loss.item())
    if ctx.rank == 0:
        # tests/agent/replicated/test_grad_buckets.py: how many gradient buckets this agent started while backward ran
        early = {"early": torch.tensor(ctx._rt.env.grad_buckets.early)} if os.environ.get("ELASTICD_TEST_EARLY") else None
        save_state(model, "ELASTICD_TEST_OUT", early)


if __name__ == "__main__":
    train()
