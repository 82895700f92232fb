"""Every torch.distributed collective a script may call, in torchrun form (no elasticd in it): each rank
records what it saw after each call and writes it to OUT_DIR/rank{r}.pt.

    torchrun --nproc_per_node 4 torchrun_collectives.py OUT_DIR

Values depend on the rank, so a collective that mixed ranks up, dropped one or answered on the wrong one
shows; objects hold tensors, nested containers and a class of the script's own.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Report:
    rank: int
    scores: dict


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    r, n = dist.get_rank(), dist.get_world_size()
    seen: dict[str, object] = {}
    base = torch.arange(6, dtype=torch.float32) + 10 * r

    # reduce, every op, to every destination; async too
    for dst in range(n):
        for name, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX), ("avg", dist.ReduceOp.AVG)):
            t = base.clone() * (dst + 1)
            dist.reduce(t, dst=dst, op=op)
            if r == dst:
                seen[f"reduce.{dst}.{name}"] = t
    t = base.clone()
    dist.reduce(t, dst=1, op=dist.ReduceOp.PRODUCT, async_op=True).wait()
    if r == 1:
        seen["reduce.async.product"] = t

    # gather and scatter
    for root in (0, n - 1):
        out = [torch.zeros(6) for _ in range(n)] if r == root else None
        dist.gather(base + 0.5, out, dst=root)
        if r == root:
            seen[f"gather.{root}"] = torch.stack(out)
        got = torch.zeros(3, dtype=torch.int64)
        chunks = [torch.full((3,), 100 * root + j, dtype=torch.int64) for j in range(n)] if r == root else None
        dist.scatter(got, chunks, src=root)
        seen[f"scatter.{root}"] = got

    # all_to_all (gloo's takes equal chunks only; NCCL's unequal ones are tested apart), single-tensor forms
    outs = [torch.zeros(2) for _ in range(n)]
    dist.all_to_all(outs, [torch.tensor([10.0 * r + j, -j]) for j in range(n)])
    seen["all_to_all.equal"] = torch.stack(outs)
    single = torch.zeros(2 * n)
    dist.all_to_all_single(single, torch.arange(2 * n, dtype=torch.float32) + 100 * r)
    seen["all_to_all_single.equal"] = single
    ins = [r + j + 1 for j in range(n)]        # I send r+j+1 rows to rank j; rank j sends me j+r+1
    outs_split = [j + r + 1 for j in range(n)]
    single = torch.zeros(sum(outs_split), 2)
    src = torch.arange(sum(ins) * 2, dtype=torch.float32).reshape(-1, 2) + 1000 * r
    work = dist.all_to_all_single(single, src, outs_split, ins, async_op=True)
    work.wait()
    seen["all_to_all_single.split"] = single

    # coalesced forms and the monitored barrier
    a, b = base.clone(), torch.tensor([float(r)])
    dist.all_reduce_coalesced([a, b])
    seen["all_reduce_coalesced"] = torch.cat([a, b])
    dist.monitored_barrier()

    # object collectives
    objs = [{"from": r, "t": base.clone(), "nested": [r, (r, "x")]}, Report(r, {"loss": 1.0 / (r + 1)})] \
        if r == 2 else [None, None]
    dist.broadcast_object_list(objs, src=2)
    seen["broadcast_object_list"] = [objs[0], objs[1].rank, objs[1].scores]
    every: list = [None] * n
    dist.all_gather_object(every, {"rank": r, "sq": torch.tensor([r * r]), "report": Report(r, {"n": r})})
    seen["all_gather_object"] = [(e["rank"], e["sq"], e["report"].rank, e["report"].scores) for e in every]
    gathered = [None] * n if r == 3 else None
    dist.gather_object(("g", r, base[:2]), gathered, dst=3)
    if r == 3:
        seen["gather_object"] = gathered
    mine: list = [None]
    dist.scatter_object_list(mine, [{"to": j, "v": torch.tensor([j])} for j in range(n)] if r == 0 else None, src=0)
    seen["scatter_object_list"] = mine[0]
    # a received object is the receiver's own: changing it changes nobody else's
    every[0]["sq"].add_(1000)
    check: list = [None] * n
    dist.all_gather_object(check, every[0]["sq"])
    seen["objects_are_copies"] = check

    torch.save(seen, os.path.join(out_dir, f"rank{r}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
