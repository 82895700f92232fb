"""A PyTorch Lightning script as people launch it with torchrun: a LightningModule with SGD, a validation
set, `Trainer(accelerator="cpu", strategy="ddp")`. It knows nothing of elasticd.

    torchrun --nproc_per_node 4 torchrun_lightning.py OUT.pt LOSSES.json

Rank 0 writes the final weights to OUT.pt, and the training losses it logged with the validation loss
Lightning synchronised over ranks to LOSSES.json.
"""

from __future__ import annotations

import gc
import json
import os
import sys

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(32, 4))
        self.losses: list[float] = []

    def training_step(self, batch: tuple, _i: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.losses.append(loss.item())
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: tuple, _i: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data(seed: int, n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, (x @ torch.randn(16, 4, generator=g)).argmax(1))


def main(out: str, losses: str) -> None:
    L.seed_everything(0, workers=True)
    model = Model()
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                        max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(model, DataLoader(data(1, 256), batch_size=16), DataLoader(data(2, 64), batch_size=16))
    if trainer.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)
        with open(losses, "w") as f:
            json.dump({"train": model.losses, "val": float(trainer.callback_metrics["val_loss"])}, f)
    # Lightning leaves the process group up: gloo can abort in interpreter teardown when it is never destroyed,
    # and can hang there when the trainer is collected only after destroy_process_group (as HF's Trainer did).
    del trainer, model
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
