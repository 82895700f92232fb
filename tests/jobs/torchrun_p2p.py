"""Point-to-point exchanges a script may make, in torchrun form (no elasticd in it): each rank records what
it received and writes it to OUT_DIR/rank{r}.pt.

    torchrun --nproc_per_node 4 torchrun_p2p.py OUT_DIR

A ring where even ranks send first and odd ones receive first; a ring where rank 0 sends first and everyone else receives first (each
receive waits for a rank that has not run yet); a pipeline forward and backward through the ranks with
isend/irecv; a batch_isend_irecv exchange with both neighbours; tagged messages received out of the order
they were sent in; objects; then a collective, which must find every rank past its messages.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    r, n = dist.get_rank(), dist.get_world_size()
    nxt, prv = (r + 1) % n, (r - 1) % n
    seen: dict[str, object] = {}

    got = torch.zeros(2)                                    # even ranks send first, odd ones receive first
    if r % 2 == 0:
        dist.send(torch.tensor([float(r), 1.5 * r]), nxt)
        dist.recv(got, prv)
    else:
        dist.recv(got, prv)
        dist.send(torch.tensor([float(r), 1.5 * r]), nxt)
    seen["ring"] = got

    token = torch.zeros(3, dtype=torch.int64)
    if r == 0:
        dist.send(token + 1, nxt)
        dist.recv(token, prv)
    else:
        dist.recv(token, prv)
        dist.send(token * 2 + r, nxt)
    seen["token_ring"] = token

    act = torch.full((4,), float(r))                        # a pipeline: forward through the ranks, then back
    if r > 0:
        dist.irecv(act, r - 1).wait()
        act = act * 2 + r
    if r < n - 1:
        dist.isend(act, r + 1).wait()
        grad = torch.zeros(4)
        dist.recv(grad, r + 1)
    else:
        grad = act.clone()
    if r > 0:
        dist.send(grad - r, r - 1)
    seen["pipeline"] = (act, grad)

    left, right = torch.zeros(2), torch.zeros(2)
    ops = [dist.P2POp(dist.isend, torch.tensor([r, 10.0 * r]), nxt), dist.P2POp(dist.isend, torch.tensor([r, -1.0]), prv),
           dist.P2POp(dist.irecv, left, prv), dist.P2POp(dist.irecv, right, nxt)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    seen["batch"] = (left, right)

    if r % 2 == 0:                                          # tags: sent 7 then 3, received 3 then 7
        works = [dist.isend(torch.tensor([7.0 + r]), nxt, tag=7), dist.isend(torch.tensor([3.0 + r]), nxt, tag=3)]
        for work in works:
            work.wait()
    else:
        a, b = torch.zeros(1), torch.zeros(1)
        dist.recv(a, prv, tag=3)
        dist.recv(b, prv, tag=7)
        seen["tags"] = (a, b)

    if r == 1:
        dist.send_object_list([{"from": r, "t": torch.arange(3)}, "second", None], dst=2)
    if r == 2:
        objs: list = [None, None, None]
        dist.recv_object_list(objs, src=1)
        seen["objects"] = objs

    total = torch.tensor([float(r)])
    dist.all_reduce(total)
    seen["after"] = total
    torch.save(seen, os.path.join(out_dir, f"rank{r}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
