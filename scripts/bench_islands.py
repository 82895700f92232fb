"""Across islands: what a deterministic gradient sum sends between islands, flat vs two-level, side by side.

M agent processes (gloo on loopback) are split into islands of consecutive agents (agent/comm/islands.py),
N logical ranks laid out uniformly over them. Each agent sums a gradient-sized tensor per rank over all N
ranks, alternately with the flat deterministic sum (an all-to-all of shards and an all-gather over all
M agents, comm/collectives.py) and the two-level one (pieces to the island's leader, the islands' own
subtrees between leaders, the total back inside), in the same processes, sum after sum. Both must give
the same bits (checked on every sum). Counted, per sum and over all agents: the bytes and messages sent
to an agent of another island. For the flat sum that is the volume of direct transfers its collectives
stand for (each agent's all-to-all splits to agents elsewhere, its shard to every agent elsewhere);
gloo's own algorithms may route it otherwise on a real network. The time per sum is loopback's, with no
slow link between islands: it shows what the extra hop through leaders costs, not what it saves on a
slow link (that needs a link to slow, which this benchmark does not emulate yet).

Last line: `cross_island_bytes_ratio=X.XX` (two-level / flat: below 1, the two-level sum sends less).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from _benchjob_common import load_average, table, tempdir

from elasticd.agent.comm.collectives import FlushEnv
from elasticd.agent.comm.islands import Islands
from elasticd.agent.comm.physical import PhysicalGroup
from elasticd.core.layout import Layout
from elasticd.ports import free_port


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agents", type=int, default=4, help="M agent processes (default 4)")
    ap.add_argument("--islands", type=int, default=2, help="islands of consecutive agents (default 2)")
    ap.add_argument("--workers", type=int, default=8, help="N logical ranks (default 8)")
    ap.add_argument("--numel", type=int, default=1_000_000,
                    help="elements of the fp32 tensor each rank contributes (default 1e6: a 4 MB gradient)")
    ap.add_argument("--repeats", type=int, default=10, help="sums of each kind, alternating (default 10)")
    ap.add_argument("--quick", action="store_true", help="smoke run: a small tensor, 2 sums of each kind")
    a = ap.parse_args()
    if a.quick:
        a.numel, a.repeats = 50_000, 2
    if not 2 <= a.islands <= a.agents <= a.workers:
        ap.error("need 2 <= --islands <= --agents <= --workers")
    return a


def _agent(rank: int, a: argparse.Namespace, port: int, out: str) -> None:
    torch.set_num_threads(1)   # M processes share the machine's cores
    phys = PhysicalGroup.connect(rank, a.agents, torch.device("cpu"), "127.0.0.1", port)
    layout = Layout.of(a.workers, a.agents)
    islands = Islands.even(a.agents, a.islands)
    hosted = [torch.randn(a.numel, generator=torch.Generator().manual_seed(r)) for r in layout.hosted(rank)]
    envs = {kind: FlushEnv(phys, a.workers, deterministic=True, layout=layout, islands=islands,
                           two_level=kind == "two-level") for kind in ("flat", "two-level")}
    got: dict[str, dict[str, list[float]]] = {k: {"seconds": [], "bytes": [], "messages": []} for k in envs}
    same = True
    try:
        for i in range(a.repeats):
            sums = {}
            for kind in (("flat", "two-level") if i % 2 == 0 else ("two-level", "flat")):
                phys.barrier()
                b, m = phys.cross_island_bytes, phys.cross_island_messages
                start = time.perf_counter()
                sums[kind] = envs[kind].sum_over_ranks(hosted)
                got[kind]["seconds"].append(time.perf_counter() - start)
                got[kind]["bytes"].append(phys.cross_island_bytes - b)
                got[kind]["messages"].append(phys.cross_island_messages - m)
            same = same and torch.equal(sums["flat"], sums["two-level"])
    finally:
        phys.close()
    torch.save({"got": got, "same": same}, out)


def main() -> None:
    a = _parse()
    port = free_port("127.0.0.1")
    ctx = mp.get_context("spawn")
    with tempdir() as tmp:
        outs = [os.path.join(tmp, f"agent{r}.pt") for r in range(a.agents)]
        procs = [ctx.Process(target=_agent, args=(r, a, port, outs[r])) for r in range(a.agents)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
            if p.exitcode != 0:
                sys.exit(f"an agent exited with {p.exitcode}")
        results = [torch.load(Path(o)) for o in outs]
    if not all(r["same"] for r in results):
        sys.exit("the flat and two-level sums differ: the two-level sum must give the flat sum's bits")
    rows, figures = [], {}
    for kind in ("flat", "two-level"):
        per_sum_bytes = sum(r["got"][kind]["bytes"][0] for r in results)
        per_sum_msgs = sum(r["got"][kind]["messages"][0] for r in results)
        # A sum ends when its slowest agent's does.
        seconds = statistics.median(max(r["got"][kind]["seconds"][i] for r in results) for i in range(a.repeats))
        figures[kind] = per_sum_bytes
        rows.append([kind, f"{per_sum_bytes / 2**20:.2f}", str(per_sum_msgs), f"{seconds * 1e3:.1f}"])
    sizes = "+".join(str(s) for s in Islands.even(a.agents, a.islands).sizes)
    print(f"N={a.workers} ranks on M={a.agents} agents in islands of {sizes} agents; {a.numel} fp32 elements "
          f"per rank ({a.numel * 4 / 2**20:.1f} MiB); {a.repeats} sums of each kind; {load_average()}")
    print(table(["sum", "MiB between islands / sum", "messages between islands / sum", "ms / sum (loopback)"],
                rows))
    print("bits: equal on every sum")
    print(f"cross_island_bytes_ratio={figures['two-level'] / figures['flat']:.2f}")


if __name__ == "__main__":
    main()
