"""The resize snapshot kept on the nodes (agent/resize/fallback.py): written whole, listed by part, and restored
by real agents over gloo, trading the parts that are on another node."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import torch
from util import agent_processes

from elasticd.agent.resize import fallback
from elasticd.agent.resize.snapshot import AgentSnapshot, GroupSnapshot, WorkerSnapshot
from elasticd.core.layout import Layout
from elasticd.core.parts import GROUPS, epoch_dir, epochs, parts
from elasticd.ports import free_port

WORKERS = 4
EPOCH = 3


def snapshot(ranks: list[int]) -> AgentSnapshot:
    model = {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.tensor([0.5])}
    groups = [GroupSnapshot(model=model, optimizer={"state": {0: {"m": torch.ones(3)}}, "param_groups": []},
                            scheduler=None)]
    workers = {r: WorkerSnapshot(rank=r, step=10 + r, rng={"torch": torch.tensor([r], dtype=torch.uint8)},
                                 loaders=[{"consumed": 7 * r}], extras={"private": torch.full((2,), float(r))})
               for r in ranks}
    return AgentSnapshot(groups=groups, workers=workers)


def _restore(rank: int, port: int, root: str, out: str) -> None:
    from elasticd.agent.comm.physical import PhysicalGroup

    phys = PhysicalGroup.connect(rank, 2, torch.device("cpu"), "127.0.0.1", port)
    try:
        snap = fallback.restore(phys, root, EPOCH, Layout.of(WORKERS, 2))
        result: dict = {"workers": {r: w.to_dict() for r, w in snap.workers.items()},
                        "groups": [g.to_dict() for g in snap.groups]}
    except fallback.SnapshotMissing as e:
        result = {"error": str(e)}
    finally:
        phys.close()
    torch.save(result, out)


def restore_on_two_nodes(tmp: Path, roots: list[Path]) -> list[dict]:
    port = free_port("127.0.0.1")
    ctx = agent_processes()
    procs = [ctx.Process(target=_restore, args=(r, port, str(roots[r]), str(tmp / f"out{r}.pt"))) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
        assert proc.exitcode == 0, f"restoring agent exited with {proc.exitcode}"
    return [torch.load(tmp / f"out{r}.pt") for r in range(2)]


def test_save_writes_each_part_whole_and_private(tmp_path: Path) -> None:
    n = fallback.save(tmp_path, EPOCH, snapshot([0, 1]), with_groups=True)
    assert n > 0
    assert parts(tmp_path, EPOCH) == [GROUPS, 0, 1]
    assert epochs(tmp_path) == [EPOCH]
    files = sorted(os.listdir(epoch_dir(tmp_path, EPOCH)))
    assert files == ["groups.pt", "w0.pt", "w1.pt"], "no temporary file may be left behind"
    for name in files:
        assert stat.S_IMODE(os.stat(epoch_dir(tmp_path, EPOCH) / name).st_mode) == 0o600
    fallback.save(tmp_path, EPOCH, snapshot([2]), with_groups=False)
    assert parts(tmp_path, EPOCH) == [GROUPS, 0, 1, 2]
    assert parts(tmp_path, EPOCH + 1) == [] and epochs(tmp_path / "nowhere") == []


def test_agents_restore_their_ranks_trading_parts_saved_on_the_other_node(tmp_path: Path) -> None:
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    # Agent 0 of the restarted job (ranks 0, 1) finds only ranks 2, 3 and the replicated state on its node;
    # agent 1 (ranks 2, 3) finds ranks 0, 1: everything it needs crosses over.
    fallback.save(a, EPOCH, snapshot([2, 3]), with_groups=True)
    fallback.save(b, EPOCH, snapshot([0, 1]), with_groups=False)
    got = restore_on_two_nodes(tmp_path, [a, b])
    want = snapshot(list(range(WORKERS)))
    for agent, ranks in ((0, [0, 1]), (1, [2, 3])):
        assert sorted(got[agent]["workers"]) == ranks
        for r in ranks:
            w, ref = got[agent]["workers"][r], want.workers[r]
            assert w["step"] == ref.step and w["loaders"] == ref.loaders
            assert torch.equal(w["rng"]["torch"], ref.rng["torch"])
            assert torch.equal(w["extras"]["private"], ref.extras["private"])
        (g,) = got[agent]["groups"]
        assert all(torch.equal(g["model"][k], want.groups[0].model[k]) for k in ("w", "b"))
        assert torch.equal(g["optimizer"]["state"][0]["m"], torch.ones(3))


def test_a_part_saved_nowhere_is_a_clear_error_on_every_agent(tmp_path: Path) -> None:
    a, b = tmp_path / "node-a", tmp_path / "node-b"
    fallback.save(a, EPOCH, snapshot([0, 1]), with_groups=False)
    fallback.save(b, EPOCH, snapshot([2]), with_groups=False)
    got = restore_on_two_nodes(tmp_path, [a, b])
    for result in got:
        assert result["error"] == ("snapshot of resize 3 lacks the replicated state and logical rank(s) [3]: "
                                   "saved on no node of the job")


def _all_tensors(x: object) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _all_tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _all_tensors(v)]
    return []


def test_restore_loads_on_the_cpu_whatever_the_agents_device(tmp_path: Path) -> None:
    """RNG states must come back as CPU tensors (torch.set_rng_state / torch.cuda.set_rng_state and numpy's
    .numpy() refuse others), so parts load onto the CPU even for an agent on another device ("meta" stands
    in for a GPU here); loading the model/optimizer moves their tensors where they belong."""
    import numpy as np

    from elasticd.agent.comm.physical import PhysicalGroup
    from elasticd.agent.slicer import rng

    np.random.seed(5)
    torch.manual_seed(5)
    snap = snapshot([0, 1, 2, 3])
    for w in snap.workers.values():
        w.rng = rng.capture().to_dict()
    expected = torch.rand(3)
    fallback.save(tmp_path, EPOCH, snap, with_groups=True)
    torch.manual_seed(6)

    got = fallback.restore(PhysicalGroup(0, 1, torch.device("meta")), tmp_path, EPOCH, Layout.of(WORKERS, 1))

    everything = [g.to_dict() for g in got.groups] + [w.to_dict() for w in got.workers.values()]
    assert {t.device.type for t in _all_tensors(everything)} == {"cpu"}
    rng.restore(rng.RngState.from_dict(got.workers[2].rng))
    assert torch.equal(torch.rand(3), expected)
