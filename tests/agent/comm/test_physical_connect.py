"""Forming the agents' group when rank 0 comes last (agent/comm/physical.py `await_store`).

In a resize the joiners are told at the go and reach the group before rank 0, which first finishes its
step and saves its snapshot; they wait for its rendezvous store by probing it. What it buys is measured by
scripts/bench_resize.py (the grow); here: the probe finds a store that comes up late, gives up at its
deadline without raising, and the group it lets in works.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time

import pytest
import torch

from elasticd.agent.comm.physical import PhysicalGroup, await_store
from elasticd.ports import free_port


def test_the_probe_returns_once_the_store_listens() -> None:
    port = free_port()
    probing = threading.Event()
    done = threading.Event()

    def probe() -> None:
        probing.set()
        await_store("127.0.0.1", port, time.monotonic() + 60)
        done.set()

    t = threading.Thread(target=probe, daemon=True)
    t.start()
    assert probing.wait(10)
    assert not done.wait(0.05), "returned while nothing listened"
    with socket.create_server(("127.0.0.1", port)):
        assert done.wait(30), "did not return once the port listened"
    t.join(10)


def test_the_probe_gives_up_at_its_deadline_and_leaves_the_error_to_the_group() -> None:
    port = free_port()   # nothing listens there
    started = time.monotonic()
    await_store("127.0.0.1", port, started + 0.2)
    assert time.monotonic() - started < 30


def _member(rank: int, world: int, port: int, entered: mp.Event, out: mp.Queue) -> None:
    if rank == 0:
        entered.wait(60)   # the others are probing (or connecting) before the store exists
    else:
        entered.set()
    group = PhysicalGroup.connect(rank, world, torch.device("cpu"), "127.0.0.1", port, timeout_s=60)
    t = torch.tensor([float(rank + 1)])
    group.all_reduce_(t)
    out.put((rank, t.item()))
    group.close()


@pytest.mark.timeout(120)
def test_a_group_whose_rank_0_comes_last_forms_and_reduces() -> None:
    ctx = mp.get_context("fork")
    world, port = 3, free_port()
    entered, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, world, port, entered, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        got = dict(out.get(timeout=90) for _ in range(world))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert got == {0: 6.0, 1: 6.0, 2: 6.0}
    assert all(p.exitcode == 0 for p in procs)
