"""A DDP training script written the way the PyTorch tutorials write one for torchrun, with nothing of
elasticd in it: ranks from the environment, `init_process_group`, a model wrapped in DDP (by a helper
module), `DistributedSampler.set_epoch`, a snapshot saved by rank 0 after every epoch and loaded when
present (so a restarted run resumes), `destroy_process_group`. Tests run it unchanged under
`python -m torch.distributed.run --nproc_per_node 4` and `elasticd run --workers 4`.

    torchrun --nproc_per_node 4 torchrun_tutorial.py EPOCHS --snapshot S.pt --out FINAL.pt [--info INFO{rank}.json]
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from tutorial_parts import Net, dataset, wrap


def ddp_setup() -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        init_process_group(backend="nccl")
        return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    init_process_group(backend="gloo")
    return torch.device("cpu")


class Trainer:
    def __init__(self, model, train_data, optimizer, snapshot_path, device):
        self.rank = int(os.environ["RANK"])
        self.device = device
        self.model = model.to(device)
        self.train_data = train_data
        self.optimizer = optimizer
        self.snapshot_path = snapshot_path
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            self._load_snapshot()
        self.model = wrap(self.model, device)

    def _load_snapshot(self):
        snapshot = torch.load(self.snapshot_path, map_location=self.device)
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"[RANK{self.rank}] Resuming training from snapshot at Epoch {self.epochs_run}", flush=True)

    def _run_batch(self, source, targets):
        self.optimizer.zero_grad()
        loss = F.cross_entropy(self.model(source), targets)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def _run_epoch(self, epoch):
        self.train_data.sampler.set_epoch(epoch)
        total = torch.zeros(())
        for source, targets in self.train_data:
            total += self._run_batch(source.to(self.device), targets.to(self.device)).cpu()
        dist.all_reduce(total)  # a logged mean loss, as tutorials print it
        if self.rank == 0:
            print(f"epoch {epoch} loss {total.item() / dist.get_world_size() / len(self.train_data):.4f}", flush=True)

    def _save_snapshot(self, epoch):
        snapshot = {"MODEL_STATE": self.model.module.state_dict(), "OPTIMIZER_STATE": self.optimizer.state_dict(),
                    "EPOCHS_RUN": epoch + 1}
        tmp = self.snapshot_path + ".tmp"
        torch.save(snapshot, tmp)
        os.replace(tmp, self.snapshot_path)  # a restart never finds half a snapshot

    def train(self, max_epochs):
        for epoch in range(self.epochs_run, max_epochs):
            self._run_epoch(epoch)
            if self.rank == 0:
                self._save_snapshot(epoch)
                hold_after_first_snapshot(epoch, self.epochs_run)
            dist.barrier()  # every rank sees the epoch's snapshot before the next one starts


def hold_after_first_snapshot(epoch, first):
    # Set by tests that kill an agent mid-run: the first run (not a restart) waits after its first snapshot
    # until that file exists, so the kill cannot land after the last step, however loaded the machine.
    hold = os.environ.get("TUTORIAL_HOLD")
    if hold and epoch == first and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
        while not os.path.exists(hold):
            time.sleep(0.02)


def main(args):
    device = ddp_setup()
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = DataLoader(dataset(), batch_size=args.batch_size, shuffle=False, sampler=DistributedSampler(dataset()))
    trainer = Trainer(model, data, optimizer, args.snapshot, device)
    trainer.train(args.total_epochs)
    if dist.get_rank() == 0:
        torch.save(trainer.model.module.state_dict(), args.out)
    # What this rank saw of torchrun's plumbing, for the tests (each rank its own file).
    info = {"env": {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")},
            "getenv": os.getenv("RANK"), "in": "RANK" in os.environ, "dict": dict(os.environ)["RANK"],
            "get_rank": dist.get_rank(), "initialized": dist.is_initialized(), "backend": str(dist.get_backend())}
    destroy_process_group()
    info["initialized_after_destroy"] = dist.is_initialized()
    if args.info:
        with open(args.info.format(rank=os.environ["RANK"]), "w") as f:
            json.dump(info, f)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="tutorial-style DDP training job")
    parser.add_argument("total_epochs", type=int)
    parser.add_argument("--batch_size", default=16, type=int)
    parser.add_argument("--snapshot", default="snapshot.pt")
    parser.add_argument("--out", default="final.pt")
    parser.add_argument("--info", default="")
    main(parser.parse_args())
    if "elasticd" not in sys.modules:
        # Real torchrun only (under elasticd this thread is one worker of an agent): leave without interpreter
        # finalization, where torch's gloo teardown can abort a rank after every result is written
        # ("terminate called without an active exception"); agent/ddp_reference.py does the same.
        sys.stdout.flush()
        os._exit(0)
