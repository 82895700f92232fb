"""Subgroups of the world, in torchrun form (no elasticd in it): each rank records what it saw after each
collective on a group and writes it to OUT_DIR/rank{r}.pt.

    torchrun --nproc_per_node 4 torchrun_groups.py OUT_DIR

Groups of even and odd ranks (across agents when elasticd runs 4 ranks on 2 devices), consecutive pairs from
new_subgroups (inside agents there), a group of three, and collectives on the default group between them.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    r = dist.get_rank()
    seen: dict[str, object] = {}
    even, odd = dist.new_group([0, 2]), dist.new_group([1, 3])
    parity = even if r % 2 == 0 else odd
    pair, _ = dist.new_subgroups(2)
    three = dist.new_group([3, 1, 0])
    seen["identity"] = (dist.get_rank(parity), dist.get_world_size(parity), dist.get_rank(pair),
                        dist.get_process_group_ranks(parity), dist.get_global_rank(pair, 1),
                        dist.get_group_rank(parity, r), dist.get_rank(three), dist.get_world_size(three))
    base = torch.arange(4, dtype=torch.float32) + 10 * r

    t = base.clone()
    dist.all_reduce(t, group=parity)
    seen["all_reduce.parity"] = t
    t = base.clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=pair)
    seen["all_reduce.max.pair"] = t
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t)                                                 # the default group in between
    seen["all_reduce.world"] = t
    t = base.clone()
    dist.broadcast(t, src=2 if r % 2 == 0 else 3, group=parity)
    seen["broadcast.parity"] = t
    out = [torch.zeros(4) for _ in range(2)]
    dist.all_gather(out, base, group=pair)
    seen["all_gather.pair"] = torch.stack(out)
    flat = torch.zeros(8)
    dist.all_gather_into_tensor(flat, base, group=parity)
    seen["all_gather_into_tensor.parity"] = flat
    t = base.clone()
    dist.reduce(t, dst=0 if r % 2 == 0 else 3, group=parity)
    seen["reduce.parity"] = t if r in (0, 3) else None
    gathered = [torch.zeros(4) for _ in range(2)] if r in (1, 3) else None
    dist.gather(base, gathered, dst=1 if r < 2 else 3, group=pair)
    seen["gather.pair"] = torch.stack(gathered) if gathered else None
    got = torch.zeros(2)
    chunks = [torch.full((2,), 100.0 * r + j) for j in range(2)] if r in (0, 2) else None
    dist.scatter(got, chunks, src=0 if r < 2 else 2, group=pair)
    seen["scatter.pair"] = got
    rs = torch.zeros(2)
    dist.reduce_scatter_tensor(rs, base, group=parity)
    seen["reduce_scatter_tensor.parity"] = rs
    a2a = torch.zeros(4)
    dist.all_to_all_single(a2a, base, group=pair)
    seen["all_to_all_single.pair"] = a2a
    dist.barrier(group=parity)
    if r != 2:
        t = base.clone()
        dist.all_reduce(t, group=three)
        seen["all_reduce.three"] = t
        objs: list = [None] * 3
        dist.all_gather_object(objs, {"r": r, "t": base[:1]}, group=three)
        seen["all_gather_object.three"] = objs
    objs = [{"from": r}] if r in (1, 2) else [None]
    dist.broadcast_object_list(objs, src=1 if r < 2 else 2, group=pair)
    seen["broadcast_object_list.pair"] = objs
    t = torch.tensor([float(r)])
    dist.all_reduce(t)
    seen["after"] = t
    torch.save(seen, os.path.join(out_dir, f"rank{r}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
