"""What the function keeps in its own local variables, carried across resizes by name.

A DDP process keeps its variables for life; here the function is re-entered after a resize, so what it
made before the loop is made again and the loop's changes to it are gone: a different result, exit 0.
A snapshot is taken in the worker's own thread, at a step boundary of `ctx.steps`, with the function's
frames on the stack, and a resumed worker reaches the start of `ctx.steps` through the same frames. So:

- **Random generators** (`torch.Generator()`, `np.random.default_rng`, `np.random.RandomState`,
  `random.Random`): their states are saved under (frame, name), and the generators the re-entered frames
  hold under the same names get them back. Names, not creation order: torch and the standard library make
  generators of their own (`RandomSampler`, `tempfile`), which would shift any count.
- **Plain values and tensors of its own** (numbers, strings, None, lists/tuples/dicts of them, and tensors
  autograd does not record, up to 64 MiB each: a step counter driving the LR, a prefetched batch,
  a best-so-far metric, early-stopping patience, a loss history): one the loop changed gets its value at
  the snapshot back, if the re-entered function starts it from the same value as before (a value that
  depends on the layout, such as how many ranks share the device, is left as the new run made it); a
  tensor if it starts with the same shape and dtype (an EMA copied from the model the resize restored
  begins with other values), unless it is a view of a model's or optimizer's state. A
  list or dict is refilled in place, so that what else holds it sees the same object; a number, string or
  tensor is rebound (a tensor is never written in place: the new run's may be a view of its dataset).
  Not the targets of `for` statements: their iterator, not the variable, decides the next value.

A method's `self` counts as locals: its attributes are looked at the same way (a trainer's `self.step`,
`self.best`, `self.rng`), unless it is a module or an optimizer. So do the attributes of an object of the
user's own classes (defined outside the standard library, site-packages and elasticd) or a namespace
(`args`) that a local holds: build-nanogpt's `DataLoaderLite` keeps its shard and position as
`train_loader.current_position`, and a resize must not send it back to the first batch. And so on down
such objects' attributes, three levels (`self.train_loader.current_position`: a loader a trainer holds).
A tensor such an object or a local replaced that is over the 64 MiB a snapshot copies (a data shard the
loader moved on to) cannot be carried: unless its bytes show it holds what it held when the loop began (a
shard reloaded), the snapshot fails naming it, rather than resume with a position in one shard and the
bytes of another.

Lists, tuples and dicts holding tensors are tensor_containers.py's, called from here.

Not seen: what library objects or closures hold, and names a frame binds only inside
the loop (made again there anyway). The process-wide streams (`torch.manual_seed`, `random.seed`,
`np.random.seed`) are carried by agent/slicer/rng.py.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import ctypes
import dis
import functools
import itertools
import json
import random
import re
import site
import sys
import sysconfig
import types
import warnings
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import torch

from elasticd.agent.capture import loader_tracking, local_modules, tensor_containers
from elasticd.agent.capture.carried import NotCarried, snapshot_state
from elasticd.agent.capture.local_arrays import (
    fingerprint,
    from_snapshot,
    is_array,
    nbytes,
    numpy_module,
    to_snapshot,
    writes,
)
from elasticd.agent.worker import current_worker

_OURS = str(Path(__file__).resolve().parents[1])   # the agent package: its frames are not the function's
_ELASTICD = str(Path(sys.modules["elasticd"].__file__ or _OURS).resolve().parent)   # the control plane's package


def _kind(obj: Any) -> str | None:
    if isinstance(obj, torch.Generator):
        return "torch"
    if isinstance(obj, random.Random) and obj is not random._inst:  # type: ignore[attr-defined]
        return "random"
    np = numpy_module()
    if np is not None:
        if isinstance(obj, np.random.Generator):
            return "numpy"
        if isinstance(obj, np.random.RandomState) and obj is not np.random.mtrand._rand:
            return "numpy_legacy"
    return None


def _get(kind: str, obj: Any) -> Any:
    if kind == "torch":
        return obj.get_state()
    if kind == "random":
        return list(obj.getstate())
    if kind == "numpy":
        return _plain(obj.bit_generator.state)
    return _plain(obj.get_state(legacy=False))


def _set(kind: str, obj: Any, state: Any) -> None:
    if kind == "torch":
        obj.set_state(state)
    elif kind == "random":
        version, internal, gauss = state
        obj.setstate((version, tuple(internal), gauss))
    elif kind == "numpy":
        obj.bit_generator.state = _unplain(state)
    else:
        obj.set_state(_unplain(state))


def _plain(x: Any) -> Any:
    """numpy's state dicts hold arrays (MT19937's key); snapshots hold tensors, numbers, strings, lists, dicts."""
    np = numpy_module()
    if np is not None and isinstance(x, np.ndarray):
        return {"ndarray": x.tolist(), "dtype": str(x.dtype)}
    if isinstance(x, np.integer if np is not None else ()):
        return int(x)
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _unplain(x: Any) -> Any:
    if isinstance(x, dict):
        if set(x) == {"ndarray", "dtype"}:
            np = numpy_module()
            assert np is not None, "a numpy generator's state, with numpy gone"
            return np.asarray(x["ndarray"], dtype=x["dtype"])
        return {k: _unplain(v) for k, v in x.items()}
    return x


def _frames(stop: CodeType) -> list[FrameType]:
    """The function's frames in this thread, outermost first: everything above the worker's entry (`stop`,
    the runtime's thread body) that is not the agent's own code. Empty outside a worker's thread."""
    frames: list[FrameType] = []
    f = sys._getframe(1)
    while f is not None and f.f_code is not stop:
        if not f.f_code.co_filename.startswith(_OURS):
            frames.append(f)
        f = f.f_back
    return frames[::-1] if f is not None else []


def _library_dirs() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    dirs = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    with contextlib.suppress(AttributeError):   # site.getsitepackages is missing in some virtualenvs
        dirs.update(site.getsitepackages())
    dirs.update((_ELASTICD, _OURS))
    return tuple(str(Path(d).resolve()) + "/" for d in dirs)


_LIBRARY_DIRS = _library_dirs()


@functools.lru_cache(maxsize=1024)
def _users_class(cls: type) -> bool:
    """`cls` is defined by the user's code: in a file of its own outside the standard library,
    site-packages and elasticd (the script, a module beside it), or in the script run as `__main__`."""
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    if not path:
        return cls.__module__ == "__main__" and module is not None
    return not str(Path(path).resolve()).startswith(_LIBRARY_DIRS)


def _carries_its_own(obj: Any) -> bool:
    """Objects whose state the runtime carries through other means (carried.py, the loaders' tracking)."""
    return isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
                            torch.optim.lr_scheduler.ReduceLROnPlateau, torch.amp.GradScaler,
                            torch.utils.data.DataLoader))


def _stateful(obj: Any) -> bool:
    """The object says what its state is: `state_dict()` and `load_state_dict()` (torch's Stateful protocol)."""
    return callable(getattr(type(obj), "state_dict", None)) and callable(getattr(type(obj), "load_state_dict", None))


def _by_protocol(name: str, obj: Any) -> bool:
    """Carried through its own state_dict()/load_state_dict(): an object of the user's classes a local other
    than a method's `self` holds (a trainer's own state_dict() is usually its checkpoint: model and all)."""
    return name != "self" and _users_class(type(obj)) and not _carries_its_own(obj) and _stateful(obj)


def _attrs(name: str, owner: Any) -> dict[str, Any] | None:
    """The attributes carried as locals: not of an object carried its own way, or through its protocol."""
    attrs = getattr(owner, "__dict__", None)
    ok = isinstance(attrs, dict) and not _carries_its_own(owner) and not _by_protocol(name, owner)
    return attrs if ok else None


def _objects(named: list[tuple[str, Any]]) -> dict[str, Any]:
    """key -> each object a local or an attribute looked into holds that is carried through its own protocol."""
    return {key: value for key, value in named if _by_protocol(key.split(":", 2)[2], value)}


# Bags of attributes scripts keep their settings and counters in (`args.lr *= 0.5` in the loop): looked into
# as an object of the user's own classes is.
_NAMESPACES = (argparse.Namespace, types.SimpleNamespace)


_DEPTH = 3   # `self.train_loader.position`: attributes of attributes, three levels down at most


def _named(frames: list[FrameType]) -> Iterator[tuple[str, Any]]:
    """('frame index:function:name', value) for each local of the function's frames but `for` targets, for
    each attribute of a method's `self` ('...:self.name') and of an object of the user's classes a local
    holds ('...:loader.position'), and so on down such objects' attributes ('...:self.loader.position'): a
    trainer's step counter or generator, a hand-written loader's position (held by the trainer or not), is
    what its loop's locals would otherwise be. Not a module's or optimizer's: those carry their own state."""
    for i, frame in enumerate(frames):
        skip = _for_targets(frame.f_code)
        for name, value in list(frame.f_locals.items()):
            if name in skip:
                continue
            yield _key(i, frame, name), value
            yield from _attributes(i, frame, name, value, {id(value)}, 1)


def _attributes(i: int, frame: FrameType, path: str, owner: Any, seen: set[int], depth: int
                ) -> Iterator[tuple[str, Any]]:
    if depth > _DEPTH:
        return
    if _mixed(owner):
        held_by = {f"{path}[{json.dumps(k)}]": v for k, v in list(owner.items())}
    elif path == "self" or _users_class(type(owner)) or type(owner) in _NAMESPACES:
        attrs = _attrs(path, owner)
        # Identifiers only (a `setattr(obj, "a.b", ...)` key could not be read back from the name).
        held_by = {f"{path}.{attr}": v for attr, v in list(attrs.items())
                   if isinstance(attr, str) and attr.isidentifier()} if attrs is not None else {}
    else:
        return
    for sub, held in held_by.items():
        yield _key(i, frame, sub), held
        if id(held) not in seen:   # each object once, under the first name met: no cycle, no double copy
            seen.add(id(held))
            yield from _attributes(i, frame, sub, held, seen, depth + 1)


_MAX_MIXED = 1_000   # entries of a dict looked into one by one


def _mixed(x: Any) -> bool:
    """A dict of a training state, holding objects carried their own way (a model, an optimizer) beside values
    the loop changes (`state = {"model": model, "opt": opt, "step": 0, "best": inf}`): looked into entry by
    entry, as an object's attributes are, since it cannot be copied whole. A dict of plain values, or of
    plain values and tensors, is copied whole (here or by tensor_containers.py)."""
    if type(x) not in _DICTS or not 0 < len(x) <= _MAX_MIXED or not all(isinstance(k, (str, int)) for k in x):
        return False
    return not _is_plain(x, [_MAX_ITEMS]) and not tensor_containers.is_container(x)


def _held(named: list[tuple[str, Any]]) -> dict[str, tuple[str, Any]]:
    """key -> (kind, generator) for every generator the function's locals hold."""
    found = {}
    for key, value in named:
        kind = _kind(value)
        if kind is not None:
            found[key] = (kind, value)
    return found


def _key(i: int, frame: FrameType, name: str) -> str:
    return f"{i}:{frame.f_code.co_qualname}:{name}"


_DICTS = (dict, collections.OrderedDict, collections.defaultdict, collections.Counter)
_MAX_ITEMS = 100_000   # a bigger container (every prediction of an epoch) is not copied into each snapshot


def _is_plain(x: Any, budget: list[int]) -> bool:
    budget[0] -= 1
    if budget[0] < 0:
        return False
    if x is None or isinstance(x, (bool, int, float, str)):
        return True
    # Containers of exactly these types: a copy of a namedtuple would come back as another type. The
    # collections' (a `deque(maxlen=k)` window of recent losses, a `defaultdict` of counts) are copied as a
    # list or dict and refilled in place, which keeps their type, maxlen and default factory.
    if type(x) in (list, tuple, collections.deque):
        return all(_is_plain(v, budget) for v in x)
    if type(x) in _DICTS:
        return all(isinstance(k, (str, int)) and _is_plain(v, budget) for k, v in x.items())
    return False


def _copy(x: Any) -> Any:
    if isinstance(x, (list, collections.deque)):
        return [_copy(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_copy(v) for v in x)
    if isinstance(x, dict):
        return {k: _copy(v) for k, v in x.items()}
    return x


@functools.lru_cache(maxsize=256)
def _for_targets(code: CodeType) -> frozenset[str]:
    """Names a `for` statement of `code` binds (`for step, (x, y) in ...`)."""
    names: set[str] = set()
    ins = list(dis.get_instructions(code))
    for i, op in enumerate(ins):
        if op.opname != "FOR_ITER":
            continue
        pending = 1   # values the target still has to take off the stack
        for nxt in ins[i + 1:]:
            if nxt.opname in ("UNPACK_SEQUENCE", "UNPACK_EX"):
                pending += (nxt.arg if nxt.opname == "UNPACK_SEQUENCE" else (nxt.arg & 0xFF) + (nxt.arg >> 8) + 1) - 1
            elif nxt.opname in ("STORE_FAST", "STORE_DEREF", "STORE_NAME", "STORE_GLOBAL"):
                names.add(nxt.argval)
                pending -= 1
            else:
                break
            if pending == 0:
                break
    return frozenset(names)


def _values(named: list[tuple[str, Any]]) -> dict[str, Any]:
    """key -> a copy of each plain value the function's locals hold."""
    return {key: _copy(value) for key, value in named if _is_plain(value, [_MAX_ITEMS])}


def _steps(name: str) -> tuple[str, list[tuple[str, Any]]]:
    """A name `_named` made: the local, then each attribute (`.name`) or dict entry (`[json key]`) below it."""
    head = re.match(r"[^.\[]*", name).group()   # type: ignore[union-attr]  # always matches
    steps: list[tuple[str, Any]] = []
    pos = len(head)
    while pos < len(name):
        if name[pos] == ".":
            attr = re.match(r"[^.\[]*", name[pos + 1:]).group()   # type: ignore[union-attr]
            steps.append((".", attr))
            pos += 1 + len(attr)
        else:
            key, end = _JSON.raw_decode(name, pos + 1)
            steps.append(("[", key))
            pos = end + 1   # past the closing bracket
    return head, steps


_JSON = json.JSONDecoder()


def _step(owner: Any, step: tuple[str, Any]) -> Any:
    kind, what = step
    return getattr(owner, what) if kind == "." else owner[what]


def _lookup(frame: FrameType, name: str) -> Any:
    head, steps = _steps(name)
    return functools.reduce(_step, steps, frame.f_locals[head])


def _rebind(frame: FrameType, values: dict[str, Any]) -> None:
    """Set local variables (and attributes of the objects they hold) of a frame further up this thread's stack."""
    local: dict[str, Any] = {}
    for name, value in values.items():
        head, steps = _steps(name)
        if not steps:
            local[name] = value
            continue
        with contextlib.suppress(AttributeError, TypeError, KeyError):   # frozen, slotted, or gone: left as it is
            owner = functools.reduce(_step, steps[:-1], frame.f_locals[head])
            kind, what = steps[-1]
            if kind == ".":
                setattr(owner, what, value)
            else:
                owner[what] = value
    if not local:
        return
    if sys.version_info >= (3, 13):
        for name, value in local.items():
            frame.f_locals[name] = value   # PEP 667: a write-through proxy
        return
    snapshot = frame.f_locals   # the fast locals as a dict, written back below
    snapshot.update(local)
    ctypes.pythonapi.PyFrame_LocalsToFast(ctypes.py_object(frame), ctypes.c_int(0))


_MAX_TENSOR_BYTES = 64 * 2**20   # a dataset held in a local is not copied into each snapshot


def _tensors(named: list[tuple[str, Any]]) -> dict[str, Any]:
    """The arrays (tensors and numpy arrays, see local_arrays.is_array) the function's locals hold, less the
    worker's `ctx.private` state and views of it: the private store carries that and swaps it under a device
    budget, so the variable must stay the registered tensor (a copy given back at re-entry would double the
    state on the device and leave the store swapping a tensor the function no longer uses)."""
    private = tensor_containers.private_storages()
    return {key: value for key, value in named
            if is_array(value) and not (isinstance(value, torch.Tensor) and tensor_containers.storage(value) in private)}


def _big(a: Any) -> bool:
    return nbytes(a) > _MAX_TENSOR_BYTES


def _fingerprint(a: Any) -> tuple[Any, ...] | None:
    """local_arrays.fingerprint, sampled over 64 MiB; None for an array whose bytes cannot be read (it is then
    never given back: no saved value can be shown to start from the same bytes)."""
    return fingerprint(a, _MAX_TENSOR_BYTES)


class LoopStart:
    """What a worker's function held when its `ctx.steps` began, for the next snapshot."""

    def __init__(self, named: list[tuple[str, Any]], tensors: dict[str, Any]) -> None:
        self.values = _values(named)
        # Only tensors whose bytes can be read: no other can be shown to start from the same bytes again.
        prints = {key: _fingerprint(t) for key, t in tensors.items()}
        self.tensor_prints = {key: p for key, p in prints.items() if p is not None}
        # Which tensors the loop replaced or wrote: another object, or a moved version counter. Held weakly:
        # a batch the loop rebinds must not stay alive (on the device) for the whole run.
        self.tensor_ids = {key: (weakref.ref(tensors[key]), writes(tensors[key])) for key in self.tensor_prints}
        # Where the models' and optimizers' tensors live (views of them are the new run's, never given back),
        # and what the function took from them before the loop (carried whether the loop changes it or not).
        models = tensor_containers.ModelState(named)
        self.storages = models.storages
        self.containers = tensor_containers.note(named, models)
        self.taken = {key for key in self.tensor_prints if models.taken_from([tensors[key]])}
        self.modules = local_modules.NotedModules(local_modules.loose(named, current_worker()))

    def changed_tensors(self, named: list[tuple[str, Any]]) -> dict[str, Any]:
        changed = {}
        for key, t in _tensors(named).items():
            if key in self.tensor_ids:
                ref, version = self.tensor_ids[key]
                if ref() is not t or writes(t) != version or key in self.taken:
                    changed[key] = t
        return changed


def begin(stop: CodeType, saved: dict[str, Any] | None) -> LoopStart:
    """At the start of ctx.steps (in the worker's thread): for a resumed worker (`saved`: its snapshot's
    entry), give the generators their states and the loop's plain values and tensors back; note where
    this run starts."""
    frames = _frames(stop)
    named = list(_named(frames))   # walked once here; again below, after values are given back
    tensors = _tensors(named)
    start = LoopStart(named, tensors)
    if saved:
        for key, (kind, obj) in _held(named).items():
            entry = saved.get("generators", {}).get(key)
            if entry is not None and entry["kind"] == kind:
                _set(kind, obj, entry["state"])
        was, now = saved.get("start", {}), saved.get("values", {})
        todo: dict[int, dict[str, Any]] = {}
        for key, value in now.items():
            if key in start.values and key in was and start.values[key] == was[key] and value != was[key]:
                _give_back(frames, key, _copy(value), todo)
        printed = saved.get("tensor_start", {})
        for key, value in saved.get("tensors", {}).items():
            if key in start.tensor_prints and _began_alike(start.tensor_prints[key], printed[key], tensors[key],
                                                           start.storages):
                # Rebound, never written in place: the new run's tensor may be a view of its dataset.
                i, _, name = key.split(":", 2)
                like = tensors[key]
                todo.setdefault(int(i), {})[name] = from_snapshot(value, getattr(like, "device", None))
        for key, value in tensor_containers.restored(saved.get("containers", {}), start.containers).items():
            _give_back(frames, key, value, todo)
        for i, values in todo.items():
            _rebind(frames[i], values)
        named_now = list(_named(frames))
        objects = _objects(named_now)
        for key, state in saved.get("stateful", {}).items():
            if key in objects:
                objects[key].load_state_dict(state)
        local_modules.restore(saved.get("modules", {}),
                              {key: v for key, v in named_now if isinstance(v, torch.nn.Module)}, _where)
        _iterate_again(frames, saved.get("iterators", {}))
    return start


def _iterators(named: list[tuple[str, Any]]) -> dict[str, tuple[str, int]]:
    """key of each variable holding a DataLoader's latest iterator, mid-way -> (key of one holding that
    loader, the loader's place among those the worker iterated, which orders the snapshot's loader states).

    A loop that makes its iterator at each epoch's first step (`if i == 0: batches = iter(loader)`) does not
    make it again when re-entered mid-epoch: `next(batches)` raised UnboundLocalError after every resize
    (pytorch/examples' DCGAN, ported). An iterator the snapshot saw mid-way is therefore made again at the
    start of ctx.steps, from the same loader, where it is missing; loader_tracking resumes it at its position."""
    loaders: dict[int, str] = {}
    for key, value in named:
        if isinstance(value, torch.utils.data.DataLoader):
            loaders.setdefault(id(value), key)
    found = {}
    for key, value in named:
        if isinstance(value, loader_tracking.Tracked) and value.resumable():
            loader_key = loaders.get(id(value.loader))
            if loader_key is not None and loader_key.split(":", 1)[0] == key.split(":", 1)[0]:
                found[key] = (loader_key, value.loader_index)
    return found


def _iterate_again(frames: list[FrameType], iterators: dict[str, tuple[str, int]]) -> None:
    todo: dict[int, dict[str, Any]] = {}
    worker = current_worker()
    for key, (loader_key, index) in iterators.items():
        i, _, name = key.split(":", 2)
        frame = frames[int(i)] if int(i) < len(frames) else None
        if frame is None or frame.f_code.co_qualname != key.split(":", 2)[1]:
            continue
        try:
            loader = _lookup(frame, loader_key.split(":", 2)[2])
        except (AttributeError, KeyError):
            continue
        if not isinstance(loader, torch.utils.data.DataLoader):
            continue
        try:
            live = _lookup(frame, name)
        except (AttributeError, KeyError):
            live = None
        if not (isinstance(live, loader_tracking.Tracked) and live.loader is loader):
            if worker is not None and worker.capture.loader_tracks is not None:
                worker.capture.loader_tracks.resume_next(index)
            todo.setdefault(int(i), {})[name] = iter(loader)   # tracked: resumed at the snapshot's position
    for i, values in todo.items():
        _rebind(frames[i], values)


def _began_alike(now: tuple[Any, ...], was: Any, live: Any, storages: set[int]) -> bool:
    """The re-entered function began a saved tensor as the first run did: with the same shape and dtype,
    whatever its bytes (an EMA copied from the model the resize restored). Never a view of a model's state
    (`w = model.weight.data`), which must stay the new run's."""
    shape, dtype, _crc = was
    return tuple(now[0]) == tuple(shape) and now[1] == dtype and not tensor_containers.views_of([live], storages)


def _give_back(frames: list[FrameType], key: str, value: Any, todo: dict[int, dict[str, Any]]) -> None:
    """Put `value` back into the variable or attribute `key`: a list or dict refilled in place (whatever else
    holds it, a logger or a closure, keeps seeing it), anything else rebound (by `_rebind`, from `todo`)."""
    i, _, name = key.split(":", 2)
    try:
        live = _lookup(frames[int(i)], name)
    except (AttributeError, KeyError):
        return
    if isinstance(live, list) and isinstance(value, list):
        live[:] = value
    elif isinstance(live, collections.deque) and isinstance(value, list):
        live.clear()
        live.extend(value)
    elif isinstance(live, dict) and isinstance(value, dict):
        live.clear()
        live.update(value)
    else:
        todo.setdefault(int(i), {})[name] = value


def _where(key: str) -> str:
    _, function, name = key.split(":", 2)
    return f"`{name}` in {function}()"


def save(stop: CodeType, start: LoopStart | None) -> dict[str, Any]:
    """What a resumed worker's `begin` needs, from the function's frames now (in the worker's thread).

    Raises:
        NotCarried: the loop replaced or changed a tensor over 64 MiB (which no snapshot copies), and its
            bytes are not those it had when the loop began.
    """
    frames = _frames(stop)
    named = list(_named(frames))   # the function's variables, walked once for every kind of state below
    changed = start.changed_tensors(named) if start is not None else {}
    for key, t in list(changed.items()):
        if not _big(t):
            continue
        del changed[key]
        if start is not None and key in start.taken:
            raise NotCarried(
                f"cannot carry {_where(key)} across the resize: it is a {nbytes(t) / 2**20:.0f} MiB copy of a "
                f"model's tensor taken before the loop, which the resumed function would take again from the "
                f"model the resize restored (under DDP it keeps the values the job began with), and arrays over "
                f"{_MAX_TENSOR_BYTES >> 20} MiB are not copied into snapshots. Keep the copy as a model "
                f"(`copy.deepcopy(model)`), which elasticd carries whole")
        if start is not None and _fingerprint(t) != start.tensor_prints[key]:
            raise NotCarried(
                f"cannot carry {_where(key)} across the resize: the loop replaced or changed this "
                f"{nbytes(t) / 2**20:.0f} MiB array since ctx.steps began, and arrays "
                f"over {_MAX_TENSOR_BYTES >> 20} MiB are not copied into snapshots. The resumed function would "
                f"start from the one it builds before the loop, with the other variables at this step (a "
                f"position in one data shard, the bytes of another). Keep it under "
                f"{_MAX_TENSOR_BYTES >> 20} MiB (smaller shards); or, where an object of yours holds it, give "
                f"its class state_dict() and load_state_dict() methods (torch's Stateful protocol) that keep "
                f"what selects it (the shard index, the position) and load it again: elasticd then carries "
                f"the object through them instead of its attributes")
    _refuse_started_cycles(named)
    was = start.values if start is not None else {}
    containers = tensor_containers.save(named, start.containers, _where) if start is not None else {}
    # Only what the loop changed: a file list or a config held in a local is not copied into every snapshot.
    now = {key: value for key, value in _values(named).items() if key in was and value != was[key]}
    return {"generators": {key: {"kind": kind, "state": _get(kind, obj)} for key, (kind, obj) in _held(named).items()},
            "start": {key: was[key] for key in now}, "values": now,
            "tensor_start": {key: list(start.tensor_prints[key]) for key in changed} if start is not None else {},
            "tensors": {key: to_snapshot(t) for key, t in changed.items()},
            "containers": containers,
            "stateful": _states(named), "iterators": _iterators(named),
            "modules": start.modules.save(named, _where) if start is not None else {}}


def _cycle_started(c: itertools.cycle) -> bool:
    """The cycle yielded something: it holds the items of its first pass (CPython keeps them as its state)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)   # itertools' pickling, deprecated in 3.12
            saved, first_pass_done = c.__reduce__()[2]
    except (TypeError, ValueError, IndexError):   # a Python without that state: assume it has started
        return True
    return bool(saved) or bool(first_pass_done)


def _refuse_started_cycles(named: list[tuple[str, Any]]) -> None:
    """`batches = itertools.cycle(loader)`: a cycle keeps every item of its first pass and replays them, and
    its position is nothing a snapshot can read back. The re-entered function's new cycle would start over
    (over a DataLoader: replaying only the batches seen since the resize, 0.08 from DDP, exit 0).

    Raises:
        NotCarried: a local or attribute holds a cycle that has yielded something.
    """
    for key, value in named:
        if type(value) is itertools.cycle and _cycle_started(value):
            raise NotCarried(
                f"cannot carry {_where(key)} across the resize: an itertools.cycle keeps the items of its first "
                f"pass and replays them, and the resumed function's new cycle would start over (over a "
                f"DataLoader, it would replay only the batches seen since the resize). For an endless loader use "
                f"`ctx.batches(loader)` (it goes on from epoch to epoch and is carried); to cycle through a "
                f"fixed list, index it by the step (`tasks[step % len(tasks)]`)")


def _states(named: list[tuple[str, Any]]) -> dict[str, Any]:
    return {key: snapshot_state(obj, _where(key)) for key, obj in _objects(named).items()}
