"""A torchrun script in HF accelerate's documented pattern (`prepare`, `accumulate`, `backward`,
`clip_grad_norm_` when gradients sync, `gather_for_metrics`), on synthetic data, with no line for elasticd.

accelerate keeps its process state in class-level dicts (`PartialState._shared_state`, ...): per process
under torchrun, per worker thread under elasticd (agent/compat/per_rank_singletons.py). Usage:
`torchrun --nproc_per_node 4 torchrun_accelerate.py OUT INFO_PREFIX`; rank 0 writes the model to OUT,
every rank what accelerate told it to INFO_PREFIX<rank>.json.
"""

import json
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader, TensorDataset


def main() -> None:
    out, info = sys.argv[1], sys.argv[2]
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)
    set_seed(42)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(384, 16, generator=g)
    y = (x @ torch.randn(16, 4, generator=g)).argmax(1)
    train = DataLoader(TensorDataset(x[:256], y[:256]), batch_size=8, shuffle=True)
    evalset = DataLoader(TensorDataset(x[256:], y[256:]), batch_size=16)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.05 * s))
    model, opt, train, evalset, sched = accelerator.prepare(model, opt, train, evalset, sched)
    synced, accuracy = 0, []
    for _epoch in range(2):
        model.train()
        for xb, yb in train:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(xb), yb)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    synced += 1
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad()
        model.eval()
        correct = total = 0
        for xb, yb in evalset:
            with torch.no_grad():
                pred = model(xb).argmax(1)
            pred, ref = accelerator.gather_for_metrics((pred, yb))
            correct += (pred == ref).sum().item()
            total += len(ref)
        accuracy.append((correct, total))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        torch.save(accelerator.unwrap_model(model).state_dict(), out)
    with open(f"{info}{accelerator.process_index}.json", "w") as f:
        json.dump({"process_index": accelerator.process_index, "num_processes": accelerator.num_processes,
                   "local_process_index": accelerator.local_process_index,
                   "main": accelerator.is_main_process, "synced": synced, "accuracy": accuracy}, f)


if __name__ == "__main__":
    main()
