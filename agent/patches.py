"""Every torch and standard-library name elasticd replaces in a training process: what, why, and when.

A worker runs the user's unchanged code in a thread of an agent that hosts several logical ranks, so a few
process-wide names must answer per worker: `torch.distributed` for the logical world, `os.environ` with the
worker's RANK, `clip_grad_norm_` once per step on shared gradients. Each concern below owns a `Ledger`; it
replaces names only through it, so the ledger knows what it changed and what was there before.

- `TABLE` is the list (docs/architecture.md shows it; a test checks it against what really changes).
- `installed()` names what is replaced in this process now.
- `remove_all()` puts back everything, newest first: a standalone run (`python train.py`) removes them when
  its function returns, so the rest of the script sees torch as it was. Agent processes keep them until
  they exit. Outside worker threads every replacement behaves as the name it replaced.
- `ELASTICD_DEBUG_PATCHES=1` logs each replacement and removal (logger `elasticd.patches`, to stderr).

This module imports nothing of ours, so that every concern can import it.
"""

from __future__ import annotations

import logging
import os
import sys
import types
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

DEBUG_VAR = "ELASTICD_DEBUG_PATCHES"
log = logging.getLogger("elasticd.patches")


class When(str, Enum):
    AGENT_START = "agent start, before the script is imported; and each run"
    RUN = "each run (the first call of the decorated function in the process)"
    CUDA_RUN = "each run on a CUDA device"
    TORCHRUN_MODE = "a torchrun-mode script is loaded"
    RESUMED = "a function re-enters after a resize or a restart"


@dataclass(frozen=True)
class Patch:
    concern: str                # the module that owns the replacement (under elasticd.agent)
    replaces: tuple[str, ...]   # the names, as a user would search for them; `*` stands for a family
    why: str
    when: When


TABLE: tuple[Patch, ...] = (
    Patch("compat.torch_dist",
          ("torch.distributed.*", "torch.nn.parallel.DistributedDataParallel",
           "torch.nn.parallel.distributed.DistributedDataParallel", "names of those imported into loaded modules"),
          "collectives, groups, ranks and DDP inside a worker address the N logical workers, not the M agents",
          When.AGENT_START),
    Patch("compat.dist_p2p", ("torch.distributed.distributed_c10d._check_op", "torch.distributed.P2POp.__init__"),
          "`P2POp(dist.isend, ...)` accepts the logical isend/irecv and the logical world", When.AGENT_START),
    Patch("compat.warning_origin", ("warnings.warn",),
          "a warning torch raises inside one of elasticd's wrappers names the user's line, not elasticd's",
          When.RUN),
    Patch("slicer.backward_hook", ("torch.autograd.backward",),
          "the end of a worker's backward is where the baton passes and the gradient flush starts", When.RUN),
    Patch("compat.worker_env", ("os.environ", "subprocess.Popen.__init__"),
          "RANK, LOCAL_RANK, WORLD_SIZE, ... are the calling worker's, as torchrun sets them per process; a "
          "subprocess a worker starts inherits them", When.RUN),
    Patch("compat.cuda_ranks", ("torch.cuda.set_device", "torch.accelerator.set_device_index",
                                "torch.accelerator.set_device_idx", "torch.Tensor.to", "torch.Tensor.cuda",
                                "torch.nn.Module.to", "torch.nn.Module.cuda"),
          "`set_device(LOCAL_RANK)` and `.to(local_rank)` in a worker mean the agent's GPU", When.CUDA_RUN),
    Patch("replicated.idioms",
          ("torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad_norm", "torch.nn.utils.clip_grad_value_",
           "torch.nn.utils.clip_grad.*", "torch.nn.utils.get_total_norm", "torch.nn.utils.clip_grads_with_norm_",
           "torch.amp.GradScaler.__init__", "torch.amp.GradScaler.unscale_",
           "torch.optim.lr_scheduler.*.__init__", "names of those imported into the function's module"),
          "clipping, gradient scaling and schedulers on replicated state act once per step, as under DDP",
          When.RUN),
    Patch("replicated.data_attr", ("torch.Tensor.data",),
          "`.data` of a shared gradient or parameter written by every worker updates it once per device", When.RUN),
    Patch("replicated.hooks", ("torch.Tensor.register_hook", "torch.nn.Module.register_*hook"),
          "a hook a worker registers on shared state runs for that worker's passes only", When.RUN),
    Patch("replicated.write_once", ("torch.nn.Module.__setattr__",),
          "`model.tau *= k` on a replicated model, written by every worker, happens once per device", When.RUN),
    Patch("capture.carried", ("torch.optim.*.__init__", "torch.optim.lr_scheduler.*.__init__",
                              "torch.amp.GradScaler.__init__", "torch.optim.swa_utils.AveragedModel.__init__",
                              "torch.nn.Module.__deepcopy__"),
          "optimizers, schedulers, scalers and model copies a worker makes itself are carried across resizes",
          When.RUN),
    Patch("capture.loader_tracking", ("torch.utils.data.DataLoader.__iter__", "__iter__ of its subclasses"),
          "a worker's own loader iterators resume at the same sample after a resize", When.RUN),
    Patch("capture.reentry_writes", ("builtins.open", "io.open"),
          "a function that re-enters and opens a file for writing again is told it empties what it wrote",
          When.RESUMED),
    Patch("compat.per_rank_singletons", ("hydra's run state", "accelerate's shared states", "sys.meta_path"),
          "singletons a process-per-rank launcher keeps once per process are kept once per worker",
          When.TORCHRUN_MODE),
    Patch("compat.per_rank_main", ('sys.modules["__main__"]',),
          "`__main__` is the calling worker's script module (pickle finds its classes as under torchrun)",
          When.TORCHRUN_MODE),
)

_BY_CONCERN = {p.concern: p for p in TABLE}
_ABSENT = object()


def _debug() -> bool:
    return os.environ.get(DEBUG_VAR, "") not in ("", "0")


def _qualname(owner: Any, name: str) -> str:
    if owner is sys.modules:
        return f"sys.modules[{name!r}]"
    if isinstance(owner, MutableMapping):
        return f"{owner.get('__name__', 'a namespace')}.{name}"
    if isinstance(owner, types.ModuleType):
        return f"{owner.__name__}.{name}"
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}.{name}"
    return f"{type(owner).__name__}.{name}"


class Ledger:
    """The replacements one concern made, with what they replaced, newest last."""

    def __init__(self, concern: str) -> None:
        self.concern = concern
        self._saved: list[tuple[Any, str, Any, bool]] = []   # (owner, name, old value, owner is a mapping)
        self._seen: set[tuple[int, str]] = set()
        self._undo: list[tuple[Callable[[], None], str]] = []

    @property
    def active(self) -> bool:
        return bool(self._saved or self._undo)

    def set(self, owner: Any, name: str, value: Any) -> None:
        """`setattr(owner, name, value)`, remembering the first value it replaces. On a class, what the
        class itself defines (absent: inherited, and deleted again on removal)."""
        key = (id(owner), name)
        if key not in self._seen:
            old = vars(owner).get(name, _ABSENT) if isinstance(owner, type) else getattr(owner, name, _ABSENT)
            self._saved.append((owner, name, old, False))
            self._seen.add(key)
        setattr(owner, name, value)
        self._changed("replaced", _qualname(owner, name))

    def set_item(self, mapping: MutableMapping[str, Any], key: str, value: Any) -> None:
        """`mapping[key] = value` (a module's globals: a name the user imported), remembering the old value."""
        ident = (id(mapping), key)
        if ident not in self._seen:
            self._saved.append((mapping, key, mapping.get(key, _ABSENT), True))
            self._seen.add(ident)
        mapping[key] = value
        self._changed("rebound", _qualname(mapping, key))

    def on_remove(self, undo: Callable[[], None], what: str) -> None:
        """A change that is not a name (an entry of sys.meta_path): `undo` reverts it."""
        self._undo.append((undo, what))
        self._changed("changed", what)

    def names(self) -> list[str]:
        return [_qualname(owner, name) for owner, name, _, _ in self._saved] + [what for _, what in self._undo]

    def restore(self) -> None:
        """Put back everything this concern replaced, newest first."""
        while self._undo:
            undo, what = self._undo.pop()
            undo()
            _trace("restored", what, self.concern)
        while self._saved:
            owner, name, old, is_mapping = self._saved.pop()
            if is_mapping:
                if old is _ABSENT:
                    owner.pop(name, None)
                else:
                    owner[name] = old
            elif old is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
            _trace("restored", _qualname(owner, name), self.concern)
        self._seen.clear()
        if self in _order:
            _order.remove(self)

    def _changed(self, what: str, target: str) -> None:
        if self not in _order:
            _order.append(self)
        _trace(what, target, self.concern)


def _trace(what: str, target: str, concern: str) -> None:
    if not _debug():
        return
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("elasticd patches: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    log.info("%s %s (%s: %s)", what, target, concern, _BY_CONCERN[concern].why)


_ledgers: dict[str, Ledger] = {}
_order: list[Ledger] = []   # the concerns with replacements in place, in the order they made their first


def ledger(concern: str) -> Ledger:
    """The ledger of a concern listed in `TABLE` (a replacement nobody listed is a KeyError at import)."""
    if concern not in _BY_CONCERN:
        raise KeyError(f"{concern!r} replaces names but is not listed in elasticd.agent.patches.TABLE")
    return _ledgers.setdefault(concern, Ledger(concern))


def installed() -> list[str]:
    """What is replaced in this process now, concern by concern."""
    return [f"{lg.concern}: {name}" for lg in _order for name in lg.names()]


def remove_all() -> None:
    """Put back every replacement in this process, the newest concern first."""
    for lg in reversed(list(_order)):
        lg.restore()


def markdown_table() -> str:
    """The table docs/architecture.md shows (a test keeps the two equal)."""
    rows = ["| replaced | why | installed |", "|---|---|---|"]
    for p in TABLE:
        names = ", ".join(f"`{n}`" if n[0].isalpha() and " " not in n else n for n in p.replaces)
        rows.append(f"| {names} | {p.why} | {p.when.value} |")
    return "\n".join(rows)
