"""A torchrun script in the style of popular GPT training scripts (nanoGPT's train.py): gradient accumulation
by setting DDP's `require_backward_grad_sync` per micro-step instead of `no_sync()`, a GradScaler,
`unscale_` + `clip_grad_norm_` on the DDP model's parameters, the learning rate written into
`param_groups` every iteration, dropout and batches drawn from each rank's own seeded global RNG, rank 0
saving the model at the end. Run unchanged under `torch.distributed.run` and `elasticd run`.

Arguments: `--iters=K --accum=A --out=PATH [--init=PATH]` (A must divide by the world size; `--init`: rank 0
also saves the model before training, for tests to see that it moved).
"""

import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

config = {"iters": 12, "accum": 8, "out": "final.pt", "init": "", "lr": 3e-3, "clip": 0.5}
for arg in sys.argv[1:]:
    key, val = arg[2:].split("=", 1)
    config[key] = type(config[key])(val)

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    init_process_group(backend="gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    assert config["accum"] % world == 0
    accum = config["accum"] // world
else:
    rank, world, accum = 0, 1, config["accum"]
torch.manual_seed(1337 + rank)

VOCAB, BLOCK = 32, 16
data = (torch.arange(4096) * 7 % VOCAB).long()


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.drop = nn.Dropout(0.1)
        self.mix = nn.Linear(32, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, x, y):
        h = self.drop(F.gelu(self.mix(self.emb(x))))
        logits = self.head(h)
        return logits, F.cross_entropy(logits.view(-1, VOCAB), y.view(-1))


def get_batch():
    ix = torch.randint(len(data) - BLOCK - 1, (4,))
    x = torch.stack([data[i:i + BLOCK] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + BLOCK] for i in ix])
    return x, y


torch.manual_seed(0)   # the same initial model on every rank, as DDP's broadcast would make it anyway
model = TinyLM()
torch.manual_seed(1337 + rank)
if rank == 0 and config["init"]:
    torch.save(model.state_dict(), config["init"])
optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
scaler = torch.amp.GradScaler("cuda", enabled=False)   # float16 off on CPU: every call passes through
if ddp:
    model = DDP(model)
raw_model = model.module if ddp else model

X, Y = get_batch()
for it in range(config["iters"]):
    lr = config["lr"] * 0.5 * (1 + math.cos(math.pi * it / config["iters"]))
    for group in optimizer.param_groups:
        group["lr"] = lr
    for micro in range(accum):
        if ddp:
            model.require_backward_grad_sync = micro == accum - 1
        _, loss = model(X, Y)
        loss = loss / accum
        X, Y = get_batch()
        scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), config["clip"])
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    if rank == 0:
        print(f"iter {it}: loss {loss.item() * accum:.4f}")

if rank == 0:
    torch.save(raw_model.state_dict(), config["out"])
if ddp:
    destroy_process_group()
    if "elasticd" not in sys.modules:
        # Real torchrun only (under elasticd this thread is one worker of an agent): leave without interpreter
        # finalization, where torch's gloo teardown once aborted a rank in CI ("terminate called without an
        # active exception") after every result was written; agent/ddp_reference.py does the same.
        sys.stdout.flush()
        os._exit(0)
