"""A Hugging Face `Trainer` script as people launch it with torchrun: a tiny GPT-2 built from its config,
synthetic token data with an evaluation set (evaluated every 4 steps: a gather over ranks of the eval
loss), `TrainingArguments` on CPU. It knows nothing of elasticd.

    torchrun --nproc_per_node 4 torchrun_hf_trainer.py OUT.pt LOSSES.json

Rank 0 writes the final weights to OUT.pt and the logged training and evaluation losses to LOSSES.json.
"""

from __future__ import annotations

import gc
import json
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 256, seq: int = 16, vocab: int = 64, seed: int = 7) -> None:
        g = torch.Generator().manual_seed(seed)
        self.data = torch.randint(0, vocab, (n, seq), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.data[i], "labels": self.data[i]}


def main(out: str, losses: str) -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir="hf_out", max_steps=8, per_device_train_batch_size=4, learning_rate=3e-3,
                             weight_decay=0.01, warmup_steps=2, lr_scheduler_type="cosine", logging_steps=1,
                             save_strategy="no", report_to=[], use_cpu=True, seed=0, dataloader_num_workers=0,
                             disable_tqdm=True, max_grad_norm=1.0, eval_strategy="steps", eval_steps=4,
                             per_device_eval_batch_size=8)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), eval_dataset=Tokens(n=40, seed=8))
    trainer.train()
    if trainer.is_world_process_zero():
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)
        with open(losses, "w") as f:
            json.dump({"train": [e["loss"] for e in trainer.state.log_history if "loss" in e],
                       "eval": [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]}, f)
    # The Trainer leaves the process group up: gloo aborted in interpreter teardown when it was never
    # destroyed, and torchrun's own run hung in 3 of 12 tries when the Trainer was collected only after
    # destroy_process_group (0 of 8 collected before).
    del trainer, model
    gc.collect()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
