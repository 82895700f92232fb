"""agent/capture/function_locals.py in process: what a resumed function gets back of its own variables.

The end-to-end case (real agents, a resize, against DDP) is tests/agent/capture/test_resize_averages_and_generators.py;
these pin the rules: loop-changed plain values come back, `for` targets and layout-dependent values do not,
generators get their states, and a frame further up the stack can be written (cells included).
"""

from __future__ import annotations

import argparse
import collections
import copy
import random
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from elasticd.agent.capture import function_locals as fl


def _entry(fn: Any, *args: Any) -> Any:
    """Stands in for the runtime's thread entry: the frames above it are 'the function'."""
    return fn(*args)


STOP = _entry.__code__


def _job(saved: dict | None, hosted: int, out: dict) -> None:
    step_count, history, label = 0, [], "warm"
    window, counts = collections.deque(maxlen=2), collections.defaultdict(int)   # refilled in place: types kept
    holder = SimpleNamespace(history=history)   # not plain: left alone, and must keep seeing `history`
    data = torch.arange(4.0)
    view = data[:2]          # a view of the data: restoring it must never write into `data`
    weight = torch.ones(2, requires_grad=True)   # autograd's: carried by the model, not here
    gen = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(2)
    coin = random.Random(3)
    start = fl.begin(STOP, saved)   # where ctx.steps begins
    out["resumed"] = (step_count, list(history), label, hosted)
    out["collections"] = (type(window), list(window), window.maxlen, type(counts), dict(counts), counts["unseen"])
    out["shared"] = holder.history is history and holder.history == history
    out["tensors"] = (view.tolist(), data.tolist(), weight.tolist())
    out["draws"] = (torch.rand(1, generator=gen).item(), float(rng.random()), coin.random())
    for epoch in range(2):   # a for target: its iterator decides, not the snapshot
        step_count += 1
        history.append(float(epoch))
        window.append(epoch + 5)
        counts["steps"] += 1
    label = "main"
    view = data[2:]
    with torch.no_grad():
        weight.mul_(3)
    hosted += 10             # changed, but it started from another value in the resumed run
    out["saved"] = fl.save(STOP, start)


def test_a_resumed_function_gets_back_what_its_loop_changed_and_nothing_else() -> None:
    first: dict = {}
    _entry(_job, None, 2, first)
    assert first["resumed"] == (0, [], "warm", 2)
    again: dict = {}
    _entry(_job, first["saved"], 4, again)    # another layout: 4 ranks share the device now
    step_count, history, label, hosted = again["resumed"]
    assert (step_count, history, label) == (2, [0.0, 1.0], "main")
    assert hosted == 4, "a value the new run started differently must stay the new run's"
    assert again["shared"], "a list must be refilled in place, not replaced"
    assert again["collections"] == (collections.deque, [5, 6], 2, collections.defaultdict, {"unseen": 0, "steps": 2}, 0)
    assert again["tensors"] == ([2.0, 3.0], [0.0, 1.0, 2.0, 3.0], [1.0, 1.0])
    # Each generator continued where the first run's was at the snapshot, not from its seed.
    assert again["draws"] != first["draws"]
    gen = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(2)
    coin = random.Random(3)
    torch.rand(1, generator=gen), rng.random(), coin.random()   # the first run's draws
    assert again["draws"] == (torch.rand(1, generator=gen).item(), float(rng.random()), coin.random())
    assert "epoch" not in " ".join(first["saved"]["values"])


def test_for_targets_are_found_through_unpacking() -> None:
    def loop() -> list[int]:
        seen = []
        for a, (b, c) in enumerate([(1, (2, 3))]):
            seen += [a, b, c]
        for x in range(2):
            seen.append(x)
        y = len(seen)   # a plain assignment, not a target
        return [y]

    assert fl._for_targets(loop.__code__) == {"a", "b", "c", "x"}
    assert loop() == [5]


def test_a_frame_up_the_stack_can_be_rebound_cells_included() -> None:
    def outer() -> tuple[int, int]:
        n, shared = 0, 0

        def reads() -> int:
            return shared

        def write() -> None:
            fl._rebind(sys._getframe(1), {"n": 5, "shared": 7})

        write()
        return n, reads()

    assert outer() == (5, 7)


class _Trainer:
    """minGPT-ddp's shape: the loop is a method, its counters and generator live on `self`."""

    def __init__(self, layout: int) -> None:
        self.step, self.best, self.layout = 0, float("inf"), layout
        self.rng = torch.Generator().manual_seed(5)
        self.model = torch.nn.Linear(1, 1)   # a module: its own state, never touched here

    def fit(self, saved: dict | None, out: dict) -> None:
        start = fl.begin(STOP, saved)
        out["resumed"] = (self.step, self.best, self.layout, torch.rand(1, generator=self.rng).item())
        for _ in range(3):
            self.step += 1
            self.best = min(self.best, 1.0 / self.step)
        self.layout += 1
        out["saved"] = fl.save(STOP, start)


def test_a_trainer_methods_self_is_carried_like_its_locals() -> None:
    first: dict = {}
    _entry(_Trainer(2).fit, None, first)
    again: dict = {}
    _entry(_Trainer(4).fit, first["saved"], again)
    step, best, layout, draw = again["resumed"]
    assert (step, best, layout) == (3, 1.0 / 3, 4)
    rng = torch.Generator().manual_seed(5)
    assert draw == [torch.rand(1, generator=rng).item() for _ in range(2)][1]


def test_tensors_of_any_kind_in_the_locals_never_fail_the_snapshot() -> None:
    def job(saved: dict | None, out: dict) -> None:
        shape_only = torch.empty(3, device="meta")   # noqa: F841 - held only: no bytes to read
        waves = torch.ones(2, dtype=torch.complex64)
        flags = torch.zeros(2, dtype=torch.bool)
        start = fl.begin(STOP, saved)
        out["seen"] = (waves.tolist(), flags.tolist())
        waves = waves * 2
        flags = ~flags
        out["saved"] = fl.save(STOP, start)

    first: dict = {}
    _entry(job, None, first)
    again: dict = {}
    _entry(job, first["saved"], again)
    assert again["seen"] == ([2 + 0j, 2 + 0j], [True, True])


class _ShardLoader:
    """build-nanogpt's DataLoaderLite, cut down: a position in a shard, and the shard's tokens."""

    def __init__(self, rank: int, shards: list[torch.Tensor]) -> None:
        self.shards, self.rank = shards, rank
        self.reset()

    def reset(self) -> None:
        self.shard = 0
        self.tokens = self.load(0)
        self.position = self.rank

    def load(self, shard: int) -> Any:
        return self.shards[shard].clone()   # loaded afresh, as np.load gives a new array each time

    def next_batch(self) -> float:
        x = float(self.tokens[self.position])
        self.position += 2
        if self.position >= len(self.tokens):
            self.shard = (self.shard + 1) % len(self.shards)
            self.tokens = self.load(self.shard)
            self.position = self.rank
        return x


class _NumpyShardLoader(_ShardLoader):
    """llm.c's loader keeps its shard's tokens as a numpy array."""

    def load(self, shard: int) -> Any:
        return self.shards[shard].numpy().copy()


class _StatefulShardLoader(_ShardLoader):
    """One that says what its state is, and loads its shard again from it (torch's Stateful protocol)."""

    def state_dict(self) -> dict:
        return {"shard": self.shard, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.shard, self.position = state["shard"], state["position"]
        self.tokens = self.load(self.shard)


def _loader_job(saved: dict | None, steps: int, out: dict, reload_val: bool = False,
                kind: type = _ShardLoader) -> None:
    shards = [torch.arange(6.0), torch.arange(6.0) + 100]
    train = kind(1, shards)
    val = kind(0, shards)
    start = fl.begin(STOP, saved)
    out["batches"] = [train.next_batch() for _ in range(steps)]
    if reload_val:
        val.reset()   # what an evaluation does: the same shard loaded again, another tensor
    out["saved"] = fl.save(STOP, start)


@pytest.mark.parametrize("kind", [_ShardLoader, _NumpyShardLoader, _StatefulShardLoader])
def test_an_object_of_the_users_class_in_a_local_is_carried_like_self(kind: type) -> None:
    """The loader's position, shard and tokens (a tensor, or a numpy array) go on where the snapshot left them,
    not from the first batch; an object with state_dict()/load_state_dict() is carried through them."""
    whole: dict = {}
    _entry(_loader_job, None, 6, whole, False, kind)
    first: dict = {}
    _entry(_loader_job, None, 4, first, False, kind)   # into the second shard
    again: dict = {}
    _entry(_loader_job, first["saved"], 2, again, False, kind)
    assert first["batches"] + again["batches"] == whole["batches"] == [1.0, 3.0, 5.0, 101.0, 103.0, 105.0]
    saved = first["saved"]
    if kind is _StatefulShardLoader:
        assert [state for key, state in saved["stateful"].items() if key.endswith(":train")] == [
            {"shard": 1, "position": 3}]
        assert not any(".tokens" in key or ".position" in key for key in [*saved["values"], *saved["tensors"]])
    else:
        assert any(key.endswith(":train.position") for key in saved["values"]), saved["values"]


def test_a_replaced_tensor_too_big_to_carry_fails_the_snapshot_unless_it_holds_what_it_began_with(
        monkeypatch: Any) -> None:
    monkeypatch.setattr(fl, "_MAX_TENSOR_BYTES", 16)   # a shard of 6 floats, 24 bytes, counts as big
    reloaded: dict = {}
    _entry(_loader_job, None, 1, reloaded, True)   # the val loader's shard reloaded: the same bytes
    assert not reloaded["saved"]["tensors"]
    again: dict = {}
    _entry(_loader_job, reloaded["saved"], 1, again)
    assert again["batches"] == [3.0]
    with pytest.raises(fl.NotCarried, match=r"cannot carry `train.tokens` in _loader_job\(\) across the resize"):
        _entry(_loader_job, None, 4, {})   # the train loader moved on to the second shard
    with pytest.raises(fl.NotCarried, match=r"cannot carry `train.tokens`"):
        _entry(_loader_job, None, 4, {}, False, _NumpyShardLoader)
    # An object carried through its own protocol: its tokens are its business, loaded again from its state.
    moved: dict = {}
    _entry(_loader_job, None, 4, moved, False, _StatefulShardLoader)
    again = {}
    _entry(_loader_job, moved["saved"], 2, again, False, _StatefulShardLoader)
    assert again["batches"] == [103.0, 105.0]


class _UnsavableState(_ShardLoader):
    def state_dict(self) -> dict:
        return {"shard": self.shard, "pick": self.load}   # a bound method: no snapshot can hold it

    def load_state_dict(self, state: dict) -> None:
        self.shard = state["shard"]


def test_an_object_whose_state_dict_a_snapshot_cannot_hold_fails_it_naming_the_variable() -> None:
    with pytest.raises(fl.NotCarried, match=r"cannot carry `(train|val)` in _loader_job\(\) across the resize: "
                                            r"state_dict\(\)\['pick'\] is a method"):
        _entry(_loader_job, None, 1, {}, False, _UnsavableState)


def _containers_job(saved: dict | None, weights: torch.Tensor, width: int, out: dict) -> None:
    torch.manual_seed(0)   # the same model in every run
    ema = {"w": weights.clone(), "step": 0}        # an EMA kept by hand, copied from the (restored) model
    losses: list = []                               # a history of loss tensors
    alias = losses                                  # what else holds it must keep seeing it
    per_device = [torch.zeros(width)]               # its shape depends on the layout: left as the new run made it
    dataset = [torch.arange(3.0), torch.arange(3.0) + 10]  # noqa: F841 - never changed: not copied into snapshots
    model = torch.nn.Linear(2, 1)
    views = [p.data for p in model.parameters()]   # the model's own state: the new run's views must stay
    ema_params = copy.deepcopy(list(model.parameters()))   # improved-diffusion's EMA: Parameters of no model
    ema_w = weights.clone()          # an EMA tensor of its own, copied from the (restored) model
    weight = model.weight.data       # a view of the model: the new run's
    start = fl.begin(STOP, saved)
    out["views"] = all(v.data_ptr() == p.data_ptr() for v, p in zip(views, model.parameters(), strict=True))
    out["ema_params"] = [(type(p).__name__, p.requires_grad, p.detach().tolist()) for p in ema_params]
    out["tensor"] = (ema_w.tolist(), weight.data_ptr() == model.weight.data_ptr())
    out["resumed"] = ({k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in ema.items()},
                      [t.item() for t in losses], alias is losses, per_device[0].tolist())
    for step in range(2):
        ema["w"].mul_(0.5).add_(weights, alpha=0.5)   # in place: only its count of writes moves
        ema["step"] += 1
        losses.append(torch.tensor(float(step) + 0.5))
        per_device[0] += 1
        views[0].add_(1.0)
        with torch.no_grad():
            for e in ema_params:
                e.mul_(0.5)
        ema_w.mul_(0.5)
        weight.add_(1.0)
    out["saved"] = fl.save(STOP, start)


def test_containers_of_tensors_the_loop_changed_come_back_as_under_ddp() -> None:
    first: dict = {}
    _entry(_containers_job, None, torch.tensor([1.0, 2.0]), 2, first)
    saved = first["saved"]["containers"]
    # Only what the loop changed, and the list once under its first name (`alias` is refilled with it).
    assert sorted(k.split(":", 2)[2] for k in saved) == ["ema", "ema_params", "losses", "per_device"], saved.keys()
    again: dict = {}
    # Resumed on another layout, from the model the resize restored: the EMA's start value differs, its shape not.
    _entry(_containers_job, first["saved"], torch.tensor([3.0, 4.0]), 4, again)
    ema, losses, shared, per_device = again["resumed"]
    assert ema == {"w": [1.0, 2.0], "step": 2}, "the EMA restarted from the restored model"
    assert losses == [0.5, 1.5] and shared, "a list must be refilled in place"
    assert per_device == [0.0, 0.0, 0.0, 0.0], "a container the new run shaped otherwise must stay the new run's"
    assert again["views"], "views of the model's parameters must stay views of the new run's model"
    assert again["tensor"] == ([0.25, 0.5], True), "the EMA tensor restarted, or the view of the model was replaced"
    torch.manual_seed(0)
    assert again["ema_params"] == [("Parameter", True, (p.detach() * 0.25).tolist())
                                   for p in torch.nn.Linear(2, 1).parameters()], "the EMA parameters restarted"
    chained: dict = {}   # and on through a second resize
    _entry(_containers_job, again["saved"], torch.tensor([5.0, 6.0]), 4, chained)
    assert chained["resumed"][1] == [0.5, 1.5, 0.5, 1.5] and chained["resumed"][0]["step"] == 4


def test_a_changed_container_too_big_to_carry_fails_the_snapshot_naming_it(monkeypatch: Any) -> None:
    from elasticd.agent.capture import tensor_containers

    monkeypatch.setattr(tensor_containers, "_MAX_BYTES", 7)   # the 2-float EMA, 8 bytes, is over the limit
    with pytest.raises(fl.NotCarried, match=r"cannot carry `ema` in _containers_job\(\) across the resize: the "
                                            r"loop changed this container"):
        _entry(_containers_job, None, torch.tensor([1.0, 2.0]), 2, {})


def _args_job(saved: dict | None, out: dict) -> None:
    args = argparse.Namespace(lr=0.1, patience=3)   # what the script parsed, changed by its loop
    state = SimpleNamespace(best=None)
    start = fl.begin(STOP, saved)
    out["resumed"] = (args.lr, args.patience, state.best)
    for _ in range(2):
        args.lr *= 0.5
        state.best = 0.25
    args.patience -= 1
    out["saved"] = fl.save(STOP, start)


def test_attributes_of_a_namespace_the_loop_changed_come_back() -> None:
    first: dict = {}
    _entry(_args_job, None, first)
    again: dict = {}
    _entry(_args_job, first["saved"], again)
    assert again["resumed"] == (0.025, 2, 0.25)


class _LoaderTrainer:
    """The loader held by a trainer, not by a local: build-nanogpt's loop moved into a Trainer class."""

    def __init__(self, kind: type) -> None:
        self.loaders = SimpleNamespace(train=kind(1, [torch.arange(6.0), torch.arange(6.0) + 100]))
        self.loaders.self_ref = self   # a cycle: looked into once

    def fit(self, saved: dict | None, steps: int, out: dict) -> None:
        start = fl.begin(STOP, saved)
        out["batches"] = [self.loaders.train.next_batch() for _ in range(steps)]
        out["saved"] = fl.save(STOP, start)


@pytest.mark.parametrize("kind", [_ShardLoader, _StatefulShardLoader])
def test_objects_held_by_the_trainers_attributes_are_carried_too(kind: type) -> None:
    first: dict = {}
    _entry(_LoaderTrainer(kind).fit, None, 4, first)   # into the second shard
    again: dict = {}
    _entry(_LoaderTrainer(kind).fit, first["saved"], 2, again)
    assert first["batches"] == [1.0, 3.0, 5.0, 101.0] and again["batches"] == [103.0, 105.0]


def _state_job(saved: dict | None, model_seed: int, out: dict) -> None:
    torch.manual_seed(model_seed)   # a resumed run's model holds the weights the resize restored: another seed here
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # A training state kept in one dict beside the model and optimizer, carried their own way.
    state = {"model": model, "opt": opt, "lr": 0.1, "seen": 0, "meta": {"tag": "a"},
             "rng": torch.Generator().manual_seed(7)}
    odd = {"a.b": 1, "x[y]": 2, 3: 4, '"q"': 5, "module": model}   # keys a name of ours must survive
    anchor = [p.detach().clone() for p in model.parameters()]   # L2-SP's anchor: the loop never changes it
    w0 = model.weight.detach().clone()
    best = copy.deepcopy(model.state_dict())                    # the best weights so far: an OrderedDict
    start = fl.begin(STOP, saved)
    out["resumed"] = {
        "state": (state["model"] is model, state["opt"] is opt, state["lr"], state["seen"], dict(state["meta"]),
                  torch.rand(1, generator=state["rng"]).item()),
        "odd": {k: v for k, v in odd.items() if k != "module"}, "odd_model": odd["module"] is model,
        "anchor": [a.tolist() for a in anchor], "w0": w0.tolist(),
        "best": (type(best), {k: v.tolist() for k, v in best.items()})}
    for _ in range(2):
        state["lr"] *= 0.5
        state["seen"] += 4
        state["meta"]["tag"] += "b"
        for k in ("a.b", "x[y]", 3, '"q"'):
            odd[k] += 1
        with torch.no_grad():
            model.weight.add_(1.0)   # training moves the model; the copies taken before the loop stay
    out["saved"] = fl.save(STOP, start)


def test_a_dict_of_a_training_state_and_copies_taken_from_the_model_come_back_as_under_ddp() -> None:
    """A resumed function gets back the values a training-state dict holds beside its model (not the model:
    the new run's), and the copies of the model's tensors it took before the loop, unchanged by the loop:
    under DDP they keep the job's first weights, and the re-entered function took them from restored ones."""
    first: dict = {}
    _entry(_state_job, None, 0, first)
    again: dict = {}
    _entry(_state_job, first["saved"], 1, again)
    is_model, is_opt, lr, seen, meta, draw = again["resumed"]["state"]
    assert (is_model, is_opt) == (True, True), "the model and optimizer in the dict must stay the new run's"
    assert (lr, seen, meta) == (0.025, 8, {"tag": "abb"})
    rng = torch.Generator().manual_seed(7)
    assert draw == [torch.rand(1, generator=rng).item() for _ in range(2)][1], "the dict's generator restarted"
    assert again["resumed"]["odd"] == {"a.b": 3, "x[y]": 4, 3: 6, '"q"': 7} and again["resumed"]["odd_model"]
    initial = first["resumed"]
    assert again["resumed"]["anchor"] == initial["anchor"], "the anchor was taken again from the restored model"
    assert again["resumed"]["w0"] == initial["w0"]
    assert again["resumed"]["best"] == initial["best"] and initial["best"][0] is collections.OrderedDict
    chained: dict = {}   # on through a second resize
    _entry(_state_job, again["saved"], 2, chained)
    assert chained["resumed"]["anchor"] == initial["anchor"] and chained["resumed"]["state"][2] == 0.025 / 4


def test_a_copy_taken_from_the_model_too_big_to_carry_fails_the_snapshot_naming_it(monkeypatch: Any) -> None:
    monkeypatch.setattr(fl, "_MAX_TENSOR_BYTES", 16)   # w0, 6 floats, counts as big; its bytes never change
    with pytest.raises(fl.NotCarried, match=r"cannot carry `w0` in _state_job\(\) across the resize: it is a 0 MiB "
                                            r"copy of a model's tensor taken before the loop"):
        _entry(_state_job, None, 0, {})


def test_names_of_dict_entries_and_attributes_read_back_whatever_the_keys() -> None:
    for name, want in [("x", ("x", [])), ("self.a.b", ("self", [(".", "a"), (".", "b")])),
                       ('s["a.b"].c', ("s", [("[", "a.b"), (".", "c")])), ('s["x[y]"][3]', ("s", [("[", "x[y]"), ("[", 3)])),
                       ('s["\\"]"]', ("s", [("[", '"]')]))]:
        assert fl._steps(name) == want


def test_a_started_itertools_cycle_fails_the_snapshot_naming_it_and_a_fresh_one_does_not() -> None:
    """A cycle replays what its first pass yielded; a resumed function's new one would start over (over a
    DataLoader: replay only the batches since the resize, 0.08 from DDP, exit 0). The resize is refused."""
    import itertools

    def job(draws: int, out: dict) -> None:
        tasks = itertools.cycle(["a", "b", "c"])
        start = fl.begin(STOP, None)
        out["drawn"] = [next(tasks) for _ in range(draws)]
        out["saved"] = fl.save(STOP, start)

    fresh: dict = {}
    _entry(job, 0, fresh)
    assert "saved" in fresh
    for draws in (1, 4):   # inside the first pass, and replaying it
        with pytest.raises(fl.NotCarried, match=r"cannot carry `tasks` in \S*job\(\) across the resize: an "
                                                r"itertools.cycle keeps the items of its first pass"):
            _entry(job, draws, {})


def test_attributes_whose_names_no_name_of_ours_could_hold_are_left_alone() -> None:
    def job(saved: dict | None, out: dict) -> None:
        holder = SimpleNamespace(count=0)
        setattr(holder, "x[y", 0)   # reachable only through getattr: not carried, and no name of it is read back
        start = fl.begin(STOP, saved)
        out["resumed"] = (holder.count, getattr(holder, "x[y"))
        holder.count += 1
        setattr(holder, "x[y", getattr(holder, "x[y") + 1)
        out["saved"] = fl.save(STOP, start)

    first: dict = {}
    _entry(job, None, first)
    again: dict = {}
    _entry(job, first["saved"], again)
    assert again["resumed"] == (1, 0)


def test_copies_taken_from_the_model_too_big_to_carry_fail_the_snapshot_saying_so(monkeypatch: Any) -> None:
    from elasticd.agent.capture import tensor_containers

    monkeypatch.setattr(tensor_containers, "_MAX_BYTES", 16)   # the anchor's 8 floats, 32 bytes, are over it
    with pytest.raises(fl.NotCarried, match=r"cannot carry `anchor` in _state_job\(\) across the resize: it holds "
                                            r"copies of a model's tensors taken before the loop"):
        _entry(_state_job, None, 0, {})
