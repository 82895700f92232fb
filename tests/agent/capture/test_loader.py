"""`ctx.batches` (agent/capture/loader.py): a walk over a DataLoader that resumes at the next unseen batch."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from elasticd.agent.capture.loader import ResumableBatches

DATA = TensorDataset(torch.arange(40).float())


def loader(rank: int = 1) -> DataLoader:
    sampler = DistributedSampler(DATA, num_replicas=2, rank=rank, shuffle=True, seed=7)
    return DataLoader(DATA, batch_size=3, sampler=sampler)   # 20 samples per rank: 7 batches, the last short


def walk(it: ResumableBatches, count: int) -> list[list[float]]:
    return [next(it)[0].tolist() for _ in range(count)]


def test_epochs_follow_each_other_with_a_new_shuffle():
    it = ResumableBatches(loader())
    first, second = walk(it, 7), walk(it, 7)
    for epoch in (first, second):
        assert len({x for b in epoch for x in b}) == 20, "an epoch is this rank's 20 samples, each once"
    assert first != second, "set_epoch must reshuffle at each new epoch"
    assert it.state_dict() == {"epoch": 1, "position": 7}   # the next epoch starts on the next batch taken


def test_a_walk_resumed_from_its_state_continues_where_it_stopped():
    torch.manual_seed(0)
    whole = walk(ResumableBatches(loader()), 17)
    rng_after_whole = torch.get_rng_state()
    for stop in (0, 3, 7, 9, 16):
        torch.manual_seed(0)
        before = ResumableBatches(loader())
        head = walk(before, stop)
        state = before.state_dict()
        after = ResumableBatches(loader())      # a new agent builds the loader again, then loads the state
        after.load_state_dict(state)
        assert head + walk(after, 17 - stop) == whole, f"resumed after {stop} batches"
        # Resuming mid-epoch re-creates the epoch's iterator, which draws a seed from the global stream:
        # that draw is already in the restored stream and must not be made twice.
        assert torch.equal(torch.get_rng_state(), rng_after_whole), f"resumed after {stop} batches"
