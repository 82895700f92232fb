"""The time-slicer in this process (one device): sharing, once-per-step updates, RNG isolation, errors."""

from __future__ import annotations

import copy
import random
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import elasticd
from elasticd.agent.runtime import WorkerFailed


class CountingSGD(torch.optim.SGD):
    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.real_steps = 0

    def step(self, closure=None):  # type: ignore[override]
        self.real_steps += 1
        return super().step(closure)


def test_hosted_workers_share_one_copy_and_update_once_per_step() -> None:
    seen: dict[int, dict] = {}

    @elasticd.elastic(workers=4)
    def train(ctx):
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 2)
        opt = CountingSGD(model.parameters(), lr=0.1)
        model, opt = ctx.replicate(model, opt)
        for _ in ctx.steps(5):
            opt.zero_grad()
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
        seen[ctx.rank] = {"model": model, "opt": opt, "ptrs": [p.data_ptr() for p in model.parameters()],
                          "state": [id(s) for s in opt.state.values()], "thread": threading.get_ident()}

    train()
    assert sorted(seen) == [0, 1, 2, 3]
    first = seen[0]
    for r in (1, 2, 3):
        assert seen[r]["model"] is first["model"]
        assert seen[r]["ptrs"] == first["ptrs"]
        assert seen[r]["state"] == first["state"]
    assert len({s["thread"] for s in seen.values()}) == 4  # one thread per logical worker
    assert first["opt"].real_steps == 5  # once per physical step, not once per worker


def _draws() -> list[float]:
    return [*torch.rand(3).tolist(), random.random(), float(np.random.rand())]


def test_each_worker_keeps_its_own_random_streams_across_switches() -> None:
    got: dict[int, list[float]] = {}

    @elasticd.elastic(workers=3)
    def train(ctx):
        torch.manual_seed(100 + ctx.rank)
        random.seed(200 + ctx.rank)
        np.random.seed(300 + ctx.rank)
        out = _draws()
        ctx.barrier()  # another worker runs (and draws) here
        out += _draws()
        got[ctx.rank] = out

    train()
    for r in range(3):
        torch.manual_seed(100 + r)
        random.seed(200 + r)
        np.random.seed(300 + r)
        assert got[r] == _draws() + _draws(), f"rank {r} saw another worker's random stream"


def test_a_worker_that_draws_leaves_the_streams_of_those_that_do_not_where_they_were() -> None:
    # Every worker starts from one object holding the process's streams, and a hand-over where no stream
    # moved swaps nothing: a worker that draws must get streams of its own, the others keep the start.
    got: dict[int, list[float]] = {}

    @elasticd.elastic(workers=3)
    def train(ctx):
        ctx.barrier()  # hand-overs where nothing moved
        out = [float(torch.rand(1))] if ctx.rank != 1 else []
        ctx.barrier()
        if ctx.rank == 2:
            out.append(float(np.random.rand()))
        ctx.barrier()
        out += _draws()
        got[ctx.rank] = out

    torch.manual_seed(7)
    random.seed(7)
    np.random.seed(7)
    train()
    for r in range(3):
        torch.manual_seed(7)
        random.seed(7)
        np.random.seed(7)
        want = [float(torch.rand(1))] if r != 1 else []
        if r == 2:
            want.append(float(np.random.rand()))
        assert got[r] == want + _draws(), f"rank {r} did not draw from its own streams"


def test_numpy_streams_stay_exact_when_workers_share_a_seed_and_cached_gaussians() -> None:
    # Same seed everywhere: the raw generator bytes coincide across workers, which is exactly where a
    # hand-over may skip numpy's get/set_state; randn's cached second Gaussian must still follow its worker.
    got: dict[int, list[float]] = {}

    @elasticd.elastic(workers=3)
    def train(ctx):
        np.random.seed(5)
        out = [float(np.random.randn())]  # caches a second Gaussian
        ctx.barrier()
        out.append(float(np.random.randn()))  # the cached one: no draw from the generator
        ctx.barrier()
        if ctx.rank == 1:
            out.append(float(np.random.rand()))  # only rank 1 moves its generator
        ctx.barrier()
        out += [float(np.random.randn()), float(np.random.rand())]
        got[ctx.rank] = out

    train()
    for r in range(3):
        np.random.seed(5)
        want = [float(np.random.randn()), float(np.random.randn())]
        if r == 1:
            want.append(float(np.random.rand()))
        want += [float(np.random.randn()), float(np.random.rand())]
        assert got[r] == want, f"rank {r}'s numpy stream was disturbed by a hand-over"


def test_python_random_streams_stay_exact_when_workers_share_a_seed_and_cached_gaussians() -> None:
    # As for numpy: equal generator bytes across workers let a hand-over skip getstate/setstate, and
    # random.gauss() hands out its cached second value without touching those bytes.
    got: dict[int, list[float]] = {}

    @elasticd.elastic(workers=3)
    def train(ctx):
        random.seed(5)
        out = [random.gauss(0.0, 1.0)]  # caches a second Gaussian
        ctx.barrier()
        out.append(random.gauss(0.0, 1.0))  # the cached one: no draw from the generator
        ctx.barrier()
        if ctx.rank == 1:
            out.append(random.random())  # only rank 1 moves its generator
        if ctx.rank == 2:
            random.seed(9)  # and rank 2 re-seeds it
        ctx.barrier()
        out += [random.gauss(0.0, 1.0), random.random()]
        got[ctx.rank] = out

    train()
    for r in range(3):
        random.seed(5)
        want = [random.gauss(0.0, 1.0), random.gauss(0.0, 1.0)]
        if r == 1:
            want.append(random.random())
        if r == 2:
            random.seed(9)
        want += [random.gauss(0.0, 1.0), random.random()]
        assert got[r] == want, f"rank {r}'s random stream was disturbed by a hand-over"


def test_streams_of_their_own_stay_exact_across_hand_overs_that_write_generator_bytes_in_place() -> None:
    # Workers seeded apart (torchrun mode's fresh streams are this case): a hand-over writes the incoming
    # worker's Mersenne Twister bytes in place instead of set_state/setstate, unless a cached Gaussian is
    # held on either side, which must then follow its worker too.
    got: dict[int, list[float]] = {}

    def draws(rank: int) -> list[float]:
        out = [float(np.random.rand()), random.random()]
        if rank != 1:
            out += [float(np.random.randn()), random.gauss(0.0, 1.0)]  # each caches a second Gaussian
        return out

    @elasticd.elastic(workers=3)
    def train(ctx):
        np.random.seed(40 + ctx.rank)
        random.seed(50 + ctx.rank)
        out = []
        for _ in range(3):
            out += draws(ctx.rank)
            ctx.barrier()
        got[ctx.rank] = out

    train()
    for r in range(3):
        np.random.seed(40 + r)
        random.seed(50 + r)
        assert got[r] == draws(r) + draws(r) + draws(r), f"rank {r} saw another worker's stream"


def test_logical_collectives_over_hosted_workers() -> None:
    got: dict[int, dict] = {}

    @elasticd.elastic(workers=4)
    def train(ctx):
        t = torch.tensor([float(ctx.rank + 1)])
        ctx.all_reduce(t)
        b = torch.tensor([float(ctx.rank * 10)])
        ctx.broadcast(b, src=2)
        g = ctx.all_gather(torch.tensor([ctx.rank, ctx.rank * ctx.rank]))
        a = torch.tensor([2.0])
        work = ctx.all_reduce(a, op="max", async_op=True)
        a2 = torch.tensor([float(ctx.rank)])
        ctx.all_reduce(a2, op="avg")
        work.wait()
        got[ctx.rank] = {"sum": t.item(), "bcast": b.item(), "gather": [x.tolist() for x in g],
                         "max": a.item(), "avg": a2.item()}

    train()
    for r in range(4):
        assert got[r] == {"sum": 10.0, "bcast": 20.0, "gather": [[i, i * i] for i in range(4)],
                          "max": 2.0, "avg": 1.5}


def test_a_gradient_changed_after_backward_is_judged_at_the_next_hand_over() -> None:
    # A worker that leaves straight from backward is not checked again at the switch (its accumulations were
    # just recorded); once it runs on, the next hand-over must check it, here a barrier's.
    @elasticd.elastic(workers=3)
    def train(ctx):
        model = torch.nn.Linear(4, 2)
        model = ctx.replicate(model)
        model(torch.ones(2, 4)).sum().backward()
        if ctx.rank == 1:
            model.weight.grad.mul_(2.0)
        ctx.barrier()

    with pytest.raises(WorkerFailed) as info:
        train()
    assert info.value.rank == 1
    assert "changed the gradient of replicated parameter 'weight' in place" in info.value.message


def test_a_raising_worker_reports_its_rank_and_traceback() -> None:
    @elasticd.elastic(workers=4)
    def train(ctx):
        for step in ctx.steps(10):
            ctx.barrier()
            if ctx.rank == 2 and step == 3:
                raise ValueError("bad batch on purpose")

    with pytest.raises(WorkerFailed) as info:
        train()
    assert info.value.rank == 2
    assert "bad batch on purpose" in info.value.message
    assert "in train" in info.value.traceback


def test_mismatched_collectives_fail_naming_both_ranks() -> None:
    @elasticd.elastic(workers=3)
    def train(ctx):
        shape = (3,) if ctx.rank == 1 else (2,)
        ctx.all_reduce(torch.zeros(shape))

    with pytest.raises(WorkerFailed) as info:
        train()
    assert "CollectiveMismatch" in info.value.message
    assert "logical ranks 0 and 1" in info.value.message


def test_a_rank_returning_early_while_others_wait_is_an_error_not_a_hang() -> None:
    @elasticd.elastic(workers=3)
    def train(ctx):
        if ctx.rank == 1:
            return
        ctx.barrier()

    with pytest.raises(WorkerFailed) as info:
        train()
    assert "returned from the function while ranks [0, 2] wait" in info.value.message



ACCUM_STEPS = 8   # a script's top-level setting, as nanoGPT's gradient_accumulation_steps


def test_a_function_that_assigns_a_module_global_fails_before_it_runs() -> None:
    """`global ACCUM_STEPS; ACCUM_STEPS //= world` would divide once per hosted worker (agent/capture/shared_globals.py)."""
    ran: list[int] = []

    @elasticd.elastic(workers=2)
    def train(ctx):
        def setup() -> None:
            global ACCUM_STEPS
            ACCUM_STEPS //= ctx.world_size
        ran.append(ctx.rank)
        setup()

    with pytest.raises(WorkerFailed) as failed:
        train()
    assert "train() assigns the module global(s) ACCUM_STEPS" in failed.value.message, failed.value.message
    assert ran == [] and ACCUM_STEPS == 8

    @elasticd.elastic(workers=2)
    def reads(ctx):
        ran.append(ACCUM_STEPS // ctx.world_size)   # reading one is what every rank does alike: fine

    reads()
    assert ran == [4, 4]


SETTINGS = SimpleNamespace(lr=0.1)   # a script's parsed arguments, at its top level
HISTORY: list[float] = []


def test_a_function_that_changes_a_module_globals_object_in_place_fails_before_it_runs() -> None:
    """`args.lr *= 0.5` or `history.append(...)` on a global would apply once per hosted worker to one object."""
    ran: list[int] = []

    @elasticd.elastic(workers=2)
    def decays(ctx):
        ran.append(ctx.rank)
        for _ in ctx.steps(2):
            SETTINGS.lr *= 0.5

    @elasticd.elastic(workers=2)
    def records(ctx):
        ran.append(ctx.rank)
        HISTORY.append(float(ctx.rank))

    for fn, name in ((decays, "SETTINGS"), (records, "HISTORY")):
        with pytest.raises(WorkerFailed) as failed:
            fn()
        assert f"changes the object(s) the module global(s) {name} name in place" in failed.value.message
    assert ran == [] and SETTINGS.lr == 0.1 and HISTORY == []

    @elasticd.elastic(workers=2)
    def copies(ctx):
        settings, history = copy.copy(SETTINGS), list(HISTORY)   # its own copies: fine
        settings.lr *= 0.5
        history.append(settings.lr)
        torch.backends.cudnn.benchmark = torch.backends.cudnn.benchmark   # a module's flag: not an object of ours
        ran.append(len(history))

    copies()
    assert ran == [1, 1] and SETTINGS.lr == 0.1


def test_a_second_ctx_steps_loop_in_one_run_fails_naming_the_one_loop_that_works() -> None:
    """Were it allowed, after a resize every loop of the re-entered function would start at the step the job
    had reached: a loop over epochs around ctx.steps would skip the first steps of every epoch."""
    ran: list[tuple[int, int]] = []

    @elasticd.elastic(workers=2)
    def epochs(ctx):
        for epoch in range(2):
            for step in ctx.steps(3):
                ran.append((epoch, step))

    with pytest.raises(WorkerFailed) as failed:
        epochs()
    assert "ctx.steps was started a second time in one run of the function" in failed.value.message
    assert "for step in ctx.steps(epochs * steps_per_epoch)" in failed.value.message
    assert {s for _, s in ran} == {0, 1, 2} and {e for e, _ in ran} == {0}, "the first loop runs whole, the second not"


def test_writes_through_a_replicated_gradients_data_are_made_once_per_device_as_once_per_rank() -> None:
    """`.data` has a version counter of its own: `p.grad.data.mul_(0.5)` went unseen and each hosted worker
    halved the shared gradient again (exit 0), and refusing it stops DINO's per-parameter clipping. While
    the gradient holds the flush's average it is now made once per device, as once per DDP
    rank, and every worker reads the average as its DDP rank does (agent/replicated/grad_data.py), when the
    device's first worker is held at a collective of the next step before its `zero_grad()` (DINO's loss
    all-reduces in the forward). Without one, it has cleared and accumulated again by the time a later
    worker writes, which is then dropped as the first worker's, made already: the same parameters (what
    that worker reads is the first worker's next gradient, the README's known gap)."""

    def job(write: bool, lr: float, hold: int) -> tuple[dict[int, list[float]], list[torch.Tensor]]:
        norms: dict[int, list[float]] = {}
        final: list[torch.Tensor] = []

        @elasticd.elastic(workers=2)
        def train(ctx):
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 2)
            model, opt = ctx.replicate(model, torch.optim.SGD(model.parameters(), lr=lr))
            g = torch.Generator().manual_seed(ctx.rank)
            for _ in ctx.steps(3):
                if hold:
                    torch.distributed.all_reduce(torch.zeros(1))
                opt.zero_grad()
                model(torch.randn(3, 4, generator=g)).sum().backward()
                norms[ctx.rank] = [p.grad.data.norm().item() for p in model.parameters()]
                if write:
                    for p in model.parameters():
                        p.grad.data.mul_(0.5)
                norms[ctx.rank] += [p.grad.data.norm().item() for p in model.parameters()]
                opt.step()
            if ctx.rank == 0:
                final.extend(p.detach().clone() for p in model.parameters())

        train()
        return norms, final

    norms, halved = job(write=True, lr=0.1, hold=1)
    assert norms[0] == norms[1] and all(n > 0 for n in norms[0])
    assert norms[0][2:] == [n * 0.5 for n in norms[0][:2]], "each worker sees its own write, once"
    _, slower = job(write=False, lr=0.05, hold=1)
    for a, b in zip(halved, slower, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (a, b)
    _, unheld = job(write=True, lr=0.1, hold=0)
    for a, b in zip(unheld, slower, strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (a, b)


class ShardedMomentum(torch.optim.Optimizer):
    """modded-nanogpt's sharded Muon, shape kept: each rank updates every world_size-th parameter, then one
    all_reduce hands every rank all the updates. Its state and its work depend on the rank."""

    def __init__(self, params, rank: int, world_size: int) -> None:
        super().__init__(params, {"lr": 0.1})
        self.rank, self.world_size = rank, world_size

    def step(self):  # type: ignore[override]
        for group in self.param_groups:
            flat = torch.zeros(sum(p.numel() for p in group["params"]))
            at = 0
            for i, p in enumerate(group["params"]):
                if i % self.world_size == self.rank:
                    buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                    buf.mul_(0.9).add_(p.grad)
                    flat[at:at + p.numel()] = buf.flatten()
                at += p.numel()
            torch.distributed.all_reduce(flat)
            at = 0
            for p in group["params"]:
                p.data.add_(flat[at:at + p.numel()].view_as(p), alpha=-group["lr"])
                at += p.numel()


@pytest.mark.parametrize("workers", [1, 2])
def test_an_optimizer_whose_step_communicates_is_refused_on_replicated_state(workers: int) -> None:
    """The replicated optimizer steps once per device, so a collective inside its step had one caller per
    device instead of one per rank: before, the other hosted worker failed with a bare `KeyError: 0` from the
    runtime's books. Refused on every M, naming what works: the model in DistributedDataParallel inside the
    function, which trains such an optimizer as a DDP process does."""
    def job(shared: bool) -> dict[int, list[torch.Tensor]]:
        params: dict[int, list[torch.Tensor]] = {}

        @elasticd.elastic(workers=workers)
        def train(ctx):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
            opt = ShardedMomentum(model.parameters(), ctx.rank, ctx.world_size)
            if shared:
                model, opt = ctx.replicate(model, opt)
            else:
                model = torch.nn.parallel.DistributedDataParallel(model)
            for _ in ctx.steps(3):
                opt.zero_grad()
                model(torch.randn(3, 4)).sum().backward()
                opt.step()
            params[ctx.rank] = [p.detach().clone() for p in model.parameters()]

        train()
        return params

    with pytest.raises(WorkerFailed) as failed:
        job(shared=True)
    assert "a collective (AllReduce) inside the replicated optimizer's step()" in failed.value.message, \
        failed.value.message
    assert "DistributedDataParallel inside the function" in failed.value.message
    owned = job(shared=False)
    for p0, p in zip(owned[0], owned[workers - 1], strict=True):
        torch.testing.assert_close(p, p0, rtol=0, atol=0)


@pytest.mark.parametrize("wrap", ["replicate", "ddp"])
def test_sparse_gradients_are_refused_up_front_naming_the_module(wrap: str) -> None:
    """An `Embedding(sparse=True)` made sparse gradients that the flat buckets cannot hold: replicated state
    failed at its first flush with `copy_() between dense and sparse Tensors` on two devices or more (and
    trained on one), the logical DDP with `reshape is not implemented for sparse tensors`."""
    @elasticd.elastic(workers=2)
    def train(ctx):
        model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 1))
        if wrap == "replicate":
            model, _ = ctx.replicate(model, torch.optim.SGD(model.parameters(), lr=0.1))
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
        for _ in ctx.steps(1):
            model(torch.tensor([1, 2])).sum().backward()

    with pytest.raises(WorkerFailed) as failed:
        train()
    assert "0 (Embedding)" in failed.value.message and "sparse gradients (sparse=True)" in failed.value.message, \
        failed.value.message
    assert "use sparse=False" in failed.value.message


def test_a_replicated_parameters_data_updates_once_per_device_and_sets_for_every_worker() -> None:
    """Through `p.data`: an in-place update (`add_`) by a later hosted worker is dropped, since the first made it
    on the shared copy, as each DDP rank makes it once on its own; a set (`copy_`) is made by each, so that a
    worker swapping other weights in for its own forward sees them there; reads see the shared memory."""
    seen: dict[int, dict[str, object]] = {}

    class DataSGD(torch.optim.SGD):   # an optimizer written the old way, through p.data, run once per step
        def step(self, closure=None):  # type: ignore[override]
            for group in self.param_groups:
                for p in group["params"]:
                    p.data.add_(p.grad, alpha=-group["lr"])

    @elasticd.elastic(workers=3)
    def train(ctx):
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1, bias=False)
        model, opt = ctx.replicate(model, DataSGD(model.parameters(), lr=1.0))
        initial = model.weight.detach().clone()   # every rank reads it before any step
        for _ in ctx.steps(1):
            opt.zero_grad()
            model(torch.ones(1, 2)).sum().backward()   # gradient 1 everywhere on every rank
            opt.step()                                                    # once per step
            model.weight.data.add_(10.0)                                  # a hand-made update: once per device
            added = model.weight.detach().clone()
            model.weight.data.copy_(torch.full((1, 2), 7.0))              # a set: made, seen by this forward
            out = model(torch.ones(1, 2)).item()
            model.weight.data.copy_(added)                                # and set back
            seen[ctx.rank] = {"out": out, "shares": model.weight.data.data_ptr() == model.weight.data_ptr()}
        seen[ctx.rank]["final"] = torch.equal(model.weight.detach(), initial - 1.0 + 10.0)

    train()
    assert all(v == {"out": 14.0, "shares": True, "final": True} for v in seen.values()), seen


def test_a_hand_written_lr_decay_on_the_replicated_optimizer_is_made_once_per_step_as_by_each_ddp_rank() -> None:
    """`g["lr"] *= 0.5` after each step: made once per hosted worker on the one shared optimizer before, so
    the rate fell 0.5 per hosted worker per step (0.28 from DDP in a probe, exit 0)."""
    lrs: dict[int, list[float]] = {}

    @elasticd.elastic(workers=3)
    def train(ctx):
        torch.manual_seed(0)
        model = torch.nn.Linear(2, 1)
        model, opt = ctx.replicate(model, torch.optim.SGD(model.parameters(), lr=0.8))
        seen = []
        for _ in ctx.steps(3):
            opt.zero_grad()
            model(torch.ones(1, 2)).sum().backward()
            opt.step()
            for g in opt.param_groups:
                g["lr"] *= 0.5
            seen.append(opt.param_groups[0]["lr"])
        lrs[ctx.rank] = seen + [opt.state_dict()["param_groups"][0]["lr"]]

    train()
    # Each worker reads its rate after its own decay, as each DDP rank does; the optimizer holds the same.
    assert all(seen == [0.4, 0.2, 0.1, 0.1] for seen in lrs.values()), lrs


def test_a_plain_attribute_written_on_the_replicated_model_is_written_once_per_step_as_by_each_ddp_rank() -> None:
    """`model.tau *= 2` (a temperature annealed on the model) was made once per hosted worker on the one shared
    model (0.15 from DDP in a probe, exit 0). Tensors a forward stores on the model stay each pass's own."""
    seen: dict[int, tuple[float, bool, bool]] = {}

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(2, 1)
            self.tau = 1.0

        def forward(self, x):
            self.last_input = x       # a forward's own stores: the next reader is this pass
            self.rows = x.shape[0]    # a number, this pass's own (a rotary cache's sequence length)
            return self.fc(x) / self.tau

    @elasticd.elastic(workers=3)
    def train(ctx):
        net = Net()
        model, opt = ctx.replicate(net, torch.optim.SGD(net.parameters(), lr=0.1))
        ok = True
        for step in ctx.steps(3):
            x = torch.full((ctx.rank + 1, 2), float(ctx.rank * 10 + step))
            opt.zero_grad()
            out = model(x)
            # read before the hand-over at the backward's end
            ok = ok and torch.equal(model.last_input, x) and model.rows == ctx.rank + 1
            out.sum().backward()
            opt.step()
            model.tau *= 2
        model.eval()
        seen[ctx.rank] = (model.tau, ok, model.training)

    train()
    assert seen == {r: (8.0, True, False) for r in range(3)}, seen


def test_a_replicated_parameters_data_converts_as_a_tensor_does_in_every_worker() -> None:
    """`int(p.data)` in a later hosted worker raised `__int__ returned non-int`: conversions are no updates."""
    seen: dict[int, tuple[int, float]] = {}

    @elasticd.elastic(workers=2)
    def train(ctx):
        model = torch.nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            model.weight.fill_(3.5)
        model, _ = ctx.replicate(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for _ in ctx.steps(1):
            model(torch.ones(1, 1)).sum().backward()
            seen[ctx.rank] = (int(model.weight.data), float(model.weight.data))

    train()
    assert seen == {0: (3, 3.5), 1: (3, 3.5)}, seen

