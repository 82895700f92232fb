"""Libraries that keep one object per process of what torchrun gives each rank: one per worker thread here.

Under torchrun every rank is a process, so a library's process-wide singleton is per rank. In torchrun
mode the ranks of an agent are threads of one process, and a singleton that holds one run's state makes
the second rank fail: Hydra's `@hydra.main` keeps its `GlobalHydra` (and the run's `HydraConfig` and
`JobRuntime`) in `hydra.core.singleton.Singleton._instances`, and raises "GlobalHydra is already
initialized" in every rank after the first. Hydra is the configuration framework most training scripts
written for torchrun use, so its run-state singletons resolve per worker thread here; its registries
(`ConfigStore`, `Plugins`, filled once at import) stay shared, as they hold the same in every process.

HF accelerate keeps its process state in the class attribute `_shared_state` of `PartialState`,
`AcceleratorState` and `GradientState` (the Borg pattern: every instance's `__dict__` is that dict). Shared by
an agent's workers, the first worker's state was every worker's: its `Accelerator()` formed the process group
and the others, finding the state made, never called `init_process_group` in their threads, so the first
collective of its DataLoader (`synchronize_rng_states`) failed in every later rank. Each class's dict now
resolves per worker thread, as accelerate's own thread-local variant does for TPU threads.

Patched when the module is first imported (a `sys.meta_path` finder), or at once if it already is; only in
torchrun mode: an `@elastic` script's agents import it as a module, so Hydra's state there is whatever its
top level made once per agent (a `compose`d config, README), which its workers share as they read it.
"""

from __future__ import annotations

import copy
import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from elasticd.agent import patches
from elasticd.agent.worker import current_worker

_LEDGER = patches.ledger("compat.per_rank_singletons")

# Hydra's classes that hold one run's state (names under hydra.core.*); the others are registries.
HYDRA_RUN_STATE = frozenset({"GlobalHydra", "HydraConfig", "JobRuntime"})


class PerWorkerInstances(dict):  # type: ignore[type-arg]
    """`Singleton._instances` with the run-state classes looked up in the calling worker's own table.

    Outside worker threads (the agent's main thread) every class uses the shared table, the dict itself.
    """

    def __init__(self, shared: dict[Any, Any], per_worker: Callable[[type], bool]) -> None:
        super().__init__(shared)
        self._per_worker = per_worker

    def _table(self, cls: Any) -> dict[Any, Any] | None:
        w = current_worker()
        if w is None or not (isinstance(cls, type) and self._per_worker(cls)):
            return None
        return w.dist.singletons

    def __contains__(self, cls: object) -> bool:
        own = self._table(cls)
        return super().__contains__(cls) if own is None else cls in own

    def __getitem__(self, cls: Any) -> Any:
        own = self._table(cls)
        return super().__getitem__(cls) if own is None else own[cls]

    def __setitem__(self, cls: Any, value: Any) -> None:
        own = self._table(cls)
        if own is None:
            super().__setitem__(cls, value)
        else:
            own[cls] = value

    def __delitem__(self, cls: Any) -> None:
        own = self._table(cls)
        if own is None:
            super().__delitem__(cls)
        else:
            del own[cls]

    def get(self, cls: Any, default: Any = None) -> Any:
        return self[cls] if cls in self else default

    def pop(self, cls: Any, *default: Any) -> Any:
        own = self._table(cls)
        return super().pop(cls, *default) if own is None else own.pop(cls, *default)

    def __deepcopy__(self, memo: dict[int, Any]) -> dict[Any, Any]:
        # Singleton.get_state (Hydra's multirun launchers): the calling thread's view, as a plain dict.
        view = {cls: v for cls, v in dict.items(self) if self._table(cls) is None}
        w = current_worker()
        if w is not None:
            view.update(w.dist.singletons)
        return copy.deepcopy(view, memo)


def _hydra_run_state(cls: type) -> bool:
    return cls.__name__ in HYDRA_RUN_STATE and cls.__module__.startswith("hydra.")


def patch_hydra_singleton(module: ModuleType) -> None:
    singleton = getattr(module, "Singleton", None)
    instances = getattr(singleton, "_instances", None)
    if singleton is None or not isinstance(instances, dict) or isinstance(instances, PerWorkerInstances):
        return  # another Hydra than the one this was written against (1.x): leave it as it is
    _LEDGER.set(singleton, "_instances", PerWorkerInstances(instances, _hydra_run_state))


class PerWorkerSharedState:
    """A class attribute that is one dict per worker thread (accelerate's `_shared_state`); outside worker
    threads, the dict the class had. Class and instance access alike, as accelerate's thread-local one."""

    def __init__(self, key: str, shared: dict[str, Any]) -> None:
        self.key = key
        self.shared = shared

    def __get__(self, obj: Any, objtype: Any = None) -> dict[str, Any]:
        w = current_worker()
        if w is None:
            return self.shared
        own = w.dist.singletons.get(self.key)
        if own is None:
            own = w.dist.singletons[self.key] = {}
        return own

    def __set__(self, obj: Any, value: dict[str, Any]) -> None:
        w = current_worker()
        if w is None:
            self.shared = value
        else:
            w.dist.singletons[self.key] = value


ACCELERATE_STATES = ("PartialState", "AcceleratorState", "GradientState")


def patch_accelerate_state(module: ModuleType) -> None:
    for name in ACCELERATE_STATES:
        cls = getattr(module, name, None)
        shared = vars(cls).get("_shared_state") if isinstance(cls, type) else None
        if isinstance(shared, dict):   # not on TPU, where accelerate made it thread-local itself
            _LEDGER.set(cls, "_shared_state", PerWorkerSharedState(f"accelerate.{name}", shared))


PATCHES: dict[str, Callable[[ModuleType], None]] = {"hydra.core.singleton": patch_hydra_singleton,
                                                    "accelerate.state": patch_accelerate_state}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the patched modules with the usual path finder and patches each right after it executes."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(name)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        loader = getattr(spec, "loader", None)
        if spec is None or loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_and_patch(module: ModuleType) -> None:
            execute(module)
            patch(module)

        loader.exec_module = exec_and_patch  # this spec's own loader object: nothing else is changed
        return spec


_finder = _PatchOnImport()


def install() -> None:
    """Patch what is imported already, and the rest when it is (idempotent)."""
    for name, patch in PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
        _LEDGER.on_remove(lambda: sys.meta_path.remove(_finder) if _finder in sys.meta_path else None,
                          "sys.meta_path")
