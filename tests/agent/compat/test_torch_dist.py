"""torch.distributed and DistributedDataParallel used directly inside the decorated function.

End to end, against the real thing: jobs in tests/jobs/ run under torch DDP / torch.distributed with 4
gloo processes (agent/ddp_reference.py, no elasticd patches) and through `elasticd run` on M=1 and M=2
devices. In process: what the patches must and must not change.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel  # bound before any patch: the Runtime rebinds it
from util import JOBS, REFERENCE_WORKERS, Reference, cli, load_state, max_rel_diff, rel_diff, rel_diffs

import elasticd
from elasticd.agent.comm.physical import PhysicalGroup
from elasticd.agent.private.registry import SwapStats, attach
from elasticd.agent.runtime import Runtime, WorkerFailed
from elasticd.core.layout import hosted_ranks
from elasticd.reference_launch import run_native_ddp

DDP_TOLERANCE = 1e-5    # max|Δ|/max|p| per tensor after training (docs/architecture.md, what must hold, 1)
VALUE_TOLERANCE = 1e-6  # float collective results: only the order of a 4-term sum differs
MOVED = 1e-3
RUN_TIMEOUT = 240.0
NEVER_USED = "module.never.weight"  # tests/jobs/ddp_inside.py: no rank uses it, so it must never move
CPU = torch.device("cpu")


def elasticd_run(job: str, devices: int, env: dict[str, str]) -> None:
    args = ["run", str(JOBS / f"{job}.py"), "--workers", str(REFERENCE_WORKERS), "--devices", str(devices)]
    run = cli(*args, env={"ELASTICD_TEST_WORKERS": str(REFERENCE_WORKERS), **env}, timeout=RUN_TIMEOUT)
    assert run.code == 0, f"`elasticd {' '.join(args)}` exited {run.code}:\n{run.output}"
    print(f"{job} N={REFERENCE_WORKERS} M={devices}: {run.seconds:.1f}s")


def native_run(job: str, env: dict[str, str]) -> None:
    """The same script under plain torch.distributed: N processes, torch's own DDP (no elasticd patches)."""
    code = run_native_ddp(str(JOBS / f"{job}.py"), None, REFERENCE_WORKERS,
                          env={"ELASTICD_TEST_WORKERS": str(REFERENCE_WORKERS), **env}, timeout=RUN_TIMEOUT)
    assert code == 0, f"reference run of {job} failed with exit code {code} (rank output above)"


# -- a model wrapped in DDP by the function itself ------------------------------------------------

@pytest.fixture(scope="module")
def ddp_inside_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Reference, dict]:
    out = tmp_path_factory.mktemp("ddp_inside_native")
    native_run("ddp_inside", {"ELASTICD_TEST_OUT": str(out / "final.pt"), "ELASTICD_TEST_INIT": str(out / "init.pt"),
                              "ELASTICD_TEST_INFO": str(out / "info.json")})
    ref = Reference(initial=load_state(out / "init.pt"), final=load_state(out / "final.pt"))
    return ref, json.loads((out / "info.json").read_text())


def test_ddp_inside_reference_is_torch_ddp_and_trains(ddp_inside_reference: tuple[Reference, dict]) -> None:
    """Guards against a vacuous comparison: the reference ran torch's DDP, and training moved the model."""
    ref, info = ddp_inside_reference
    assert info == {"wrapper": "torch.nn.parallel.distributed.DistributedDataParallel", "world": 4,
                    "initialized": True}
    moved = {k: rel_diff(ref.initial[k], ref.final[k]) for k in ref.final if ref.final[k].is_floating_point()}
    assert moved.pop(NEVER_USED) == 0.0, "a parameter no rank uses moved under real DDP"
    assert all(d > MOVED for d in moved.values()), f"tensors that barely changed in training: {moved}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("devices", [1, 2])
def test_ddp_inside_matches_real_ddp(devices: int, ddp_inside_reference: tuple[Reference, dict],
                                     tmp_path: Path) -> None:
    ref, _ = ddp_inside_reference
    elasticd_run("ddp_inside", devices, {"ELASTICD_TEST_OUT": str(tmp_path / "final.pt"),
                                         "ELASTICD_TEST_INIT": str(tmp_path / "init.pt"),
                                         "ELASTICD_TEST_INFO": str(tmp_path / "info.json")})
    info = json.loads((tmp_path / "info.json").read_text())
    assert info == {"wrapper": "elasticd.agent.compat.logical_ddp.LogicalDDP", "world": 4, "initialized": True}
    # Every rank built a different model: DDP's constructor must have made them all rank 0's.
    assert max_rel_diff(ref.initial, load_state(tmp_path / "init.pt")) == 0.0
    got = load_state(tmp_path / "final.pt")
    diffs = rel_diffs(ref.final, got)
    print(f"ddp_inside M={devices}: max rel diff vs torch DDP {max(diffs.values()):.3g}")
    too_far = {k: d for k, d in diffs.items() if d > DDP_TOLERANCE}
    assert not too_far, f"differs from torch DDP on {devices} device(s) (max|Δ|/max|p|): {too_far}"
    assert torch.equal(got[NEVER_USED], ref.initial[NEVER_USED]), "grad of an unused parameter must stay None"


# -- collectives through torch.distributed and ctx ------------------------------------------------

@pytest.fixture(scope="module")
def collectives_reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, torch.Tensor]]:
    out = tmp_path_factory.mktemp("collectives_native")
    native_run("mixed_collectives", {"ELASTICD_TEST_OUT": str(out)})
    return {r: load_state(out / f"rank{r}.pt") for r in range(REFERENCE_WORKERS)}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("devices", [1, 2])
def test_mixed_collectives_match_torch_distributed(
        devices: int, collectives_reference: dict[int, dict[str, torch.Tensor]], tmp_path: Path) -> None:
    elasticd_run("mixed_collectives", devices, {"ELASTICD_TEST_OUT": str(tmp_path)})
    worst = 0.0
    for rank, ref in collectives_reference.items():
        got = load_state(tmp_path / f"rank{rank}.pt")
        assert sorted(got) == sorted(ref), f"rank {rank} ran different collectives"
        for name, want in ref.items():
            have = got[name]
            assert have.dtype == want.dtype and have.shape == want.shape, f"rank {rank} {name}: {have} vs {want}"
            if want.is_floating_point():
                d = rel_diff(want, have)
                worst = max(worst, d)
                assert d <= VALUE_TOLERANCE, f"rank {rank} {name}: {have} vs torch.distributed {want}"
            else:
                assert torch.equal(have, want), f"rank {rank} {name}: {have} vs torch.distributed {want}"
    print(f"mixed_collectives M={devices}: worst float rel diff {worst:.3g}")


# -- in process: what the patches change, and what they leave alone -------------------------------

def test_inside_workers_ddp_is_logical_with_ddp_surface() -> None:
    got: dict[int, dict] = {}

    @elasticd.elastic(workers=2)
    def train(ctx):
        inner = nn.Linear(3, 1)
        model = DistributedDataParallel(inner)  # the name this module bound at import
        local = nn.Linear(3, 1)
        local.load_state_dict(inner.state_dict())
        x = torch.full((2, 3), float(ctx.rank + 1))
        local(x).sum().backward()  # this rank's own gradient, for the expected average
        with model.no_sync():
            model(x).sum().backward()
        unsynced = inner.weight.grad.clone()
        inner.zero_grad()
        model(x).sum().backward()
        got[ctx.rank] = {"isinstance": isinstance(model, DistributedDataParallel), "module": model.module is inner,
                         "keys": sorted(model.state_dict()), "local": local.weight.grad.clone(),
                         "unsynced": unsynced, "synced": inner.weight.grad.clone()}

    train()
    mean = (got[0]["local"] + got[1]["local"]) / 2
    for r in (0, 1):
        assert got[r]["isinstance"] and got[r]["module"]
        assert got[r]["keys"] == ["module.bias", "module.weight"]
        assert torch.equal(got[r]["unsynced"], got[r]["local"]), "no_sync must leave the local gradient"
        assert torch.allclose(got[r]["synced"], mean), "a synced backward must average over the logical ranks"


def _ddp_steps(ctx):
    torch.manual_seed(ctx.rank)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in ctx.steps(4):
        opt.zero_grad()
        model(torch.randn(8, 64)).pow(2).mean().backward()  # switch point: other workers' models run
        opt.step()
    return [t.detach().clone() for t in model.state_dict().values()]


def test_ddp_wrapped_model_is_private_state_swapped_under_a_budget() -> None:
    """The wrapped model is registered with ctx.private: it leaves the device between turns, unchanged."""
    def run(budget: int | None) -> tuple[dict, SwapStats]:
        runtime = Runtime(_ddp_steps, 4, hosted_ranks(4, 1, 0), PhysicalGroup(0, 1, CPU), CPU)
        store = attach(runtime, budget)
        return runtime.run(), store.stats

    free, free_stats = run(None)
    budget = 36_000  # one worker's model with its gradients (~35 kB); four workers need four times that
    tight, stats = run(budget)
    assert free_stats.bytes_out == 0 and stats.bytes_out > 0 and stats.peak_bytes <= budget, stats
    for r in range(4):
        assert all(torch.equal(a, b) for a, b in zip(free[r], tight[r], strict=True)), f"rank {r} changed by swapping"


def test_process_groups_elasticd_did_not_make_are_refused_inside_workers() -> None:
    """new_group makes subgroups of the logical world (tests/agent/compat/test_torch_dist_groups.py); a process group from
    elsewhere, and DDP over a subgroup, are refused by name."""
    errors: dict[str, str] = {}

    @elasticd.elastic(workers=2)
    def train(ctx):
        sub = dist.new_group([0, 1])
        for name, call in {
            "all_reduce": lambda: dist.all_reduce(torch.ones(1), group=object()),
            "get_rank": lambda: dist.get_rank(group=object()),
            "ddp": lambda: DistributedDataParallel(nn.Linear(1, 1), process_group=object()),
            "ddp_subgroup": lambda: DistributedDataParallel(nn.Linear(1, 1), process_group=sub),
        }.items():
            try:
                call()
            except NotImplementedError as e:
                errors[name] = str(e)

    train()
    assert sorted(errors) == ["all_reduce", "ddp", "ddp_subgroup", "get_rank"], errors
    assert all("elasticd" in msg for msg in errors.values()), errors


class _CommunicatesInBackward(torch.autograd.Function):
    """SyncBatchNorm's pattern: an all_reduce in backward, run the way autograd runs a CUDA backward pass, on
    a thread that is no worker's (autograd's device thread; a plain thread here, where autograd runs a CPU
    pass on the caller's)."""

    @staticmethod
    def forward(ctx, x):  # noqa: ANN001, ANN205
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        raised: list[BaseException] = []

        def communicate() -> None:
            try:
                dist.all_reduce(grad.clone())
            except BaseException as e:  # noqa: BLE001 - handed back to the backward pass below
                raised.append(e)

        t = threading.Thread(target=communicate)
        t.start()
        t.join()
        if raised:
            raise raised[0]
        return grad


def test_a_collective_from_another_thread_during_backward_fails_loudly() -> None:
    """It would reach the agents' own group (M agents, not N ranks) and could not wait for the other workers."""
    def train(ctx):
        model = ctx.replicate(nn.Linear(3, 1))
        _CommunicatesInBackward.apply(model(torch.ones(2, 3))).sum().backward()

    runtime = Runtime(train, 2, hosted_ranks(2, 1, 0), PhysicalGroup(0, 1, CPU), CPU)
    with pytest.raises(WorkerFailed) as failed:
        runtime.run()
    assert "torch.distributed.all_reduce was called from a thread of its own during logical rank 0's backward" \
        in failed.value.message, failed.value.message
    assert "SyncBatchNorm" in failed.value.message
    assert not dist.is_initialized()   # after the run, other threads get torch's own answers again


def test_outside_workers_the_real_torch_distributed_answers() -> None:
    """The agent's own thread (and physical.py) keep torch's functions, even with a real group up."""
    import elasticd.agent.comm.physical
    from elasticd.agent.compat import torch_dist

    torch_dist.install()
    assert elasticd.agent.comm.physical.dist is dist.distributed_c10d
    assert not hasattr(dist.distributed_c10d.all_reduce, "__elasticd_logical__")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        real = DistributedDataParallel(nn.Linear(2, 2))
        assert type(real) is torch_dist.RealDDP and isinstance(real, DistributedDataParallel)
        t = torch.ones(1)
        dist.all_reduce(t)
        assert (dist.get_rank(), dist.get_world_size(), t.item()) == (0, 1, 1.0)  # the 1-process group's
        seen: dict[int, tuple] = {}

        @elasticd.elastic(workers=3)
        def train(ctx):
            t = torch.ones(1)
            dist.all_reduce(t)
            seen[ctx.rank] = (dist.get_rank(), dist.get_world_size(), t.item())

        train()
        assert seen == {r: (r, 3, 3.0) for r in range(3)}  # the logical world, not the real group
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def test_mismatched_torch_distributed_calls_fail_naming_both_ranks() -> None:
    @elasticd.elastic(workers=2)
    def train(ctx):
        if dist.get_rank() == 0:
            dist.all_reduce(torch.zeros(2))
        else:
            dist.broadcast(torch.zeros(2), src=0)

    with pytest.raises(WorkerFailed) as info:
        train()
    assert "CollectiveMismatch" in info.value.message and "logical ranks 0 and 1" in info.value.message


@pytest.mark.timeout(300)
def test_a_foreign_process_group_fails_a_real_run_with_its_name() -> None:
    """Through `elasticd run` on 2 agents (a real physical group, where the call would otherwise reach it)."""
    args = ["run", str(JOBS / "unsupported_call.py"), "--workers", "4", "--devices", "2"]
    run = cli(*args, env={"ELASTICD_TEST_WORKERS": "4"}, timeout=RUN_TIMEOUT)
    assert run.code == 1, run.output
    assert "NotImplementedError: elasticd: torch.distributed.all_reduce on a process group elasticd did not " \
           "make is not supported" in run.output
    assert "logical rank 0" in run.output


@pytest.mark.timeout(600)
def test_a_function_ported_from_torchrun_sees_torchruns_environment_in_both_runners(tmp_path: Path) -> None:
    """`elasticd run --ddp` is the reference users compare with: each rank gets the variables torchrun sets,
    and the function's own init_process_group / destroy_process_group work there as they do under elasticd."""
    seen = {}
    for name in ("native", "elasticd"):
        out = tmp_path / name
        out.mkdir()
        if name == "native":
            native_run("env_ranks", {"ELASTICD_TEST_OUT": str(out)})
        else:
            elasticd_run("env_ranks", 2, {"ELASTICD_TEST_OUT": str(out)})
        seen[name] = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(REFERENCE_WORKERS)}
    want = {r: {"rank": r, "world": REFERENCE_WORKERS, "local_rank": r, "get_rank": r, "ctx_rank": r,
                "sum_of_ranks": 6.0, "pickled_as": "env_ranks"} for r in range(REFERENCE_WORKERS)}
    assert seen["native"] == want
    assert seen["elasticd"] == want
