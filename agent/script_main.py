"""torchrun mode: a script with no `@elastic` function runs its `__main__` once per logical worker.

`torchrun --nproc_per_node N script.py ARGS` starts N processes that each run the script as `__main__`
with `sys.argv == [script.py, *ARGS]` and their own RANK, LOCAL_RANK, ... in the environment. Here each
logical worker thread executes the script's code in a fresh `__main__` namespace of its own, so every
module-level name of the script (its model, optimizer, loader, `Trainer`) is per worker, as per process;
what the script imports is shared by the workers of an agent (one `sys.modules`), which is why a script
may not keep mutable state in the modules it imports (docs/torchrun-mode.md). Its environment
variables come from agent/compat/worker_env.py, its `init_process_group` / `destroy_process_group` act on
the logical world (agent/compat/torch_dist.py).

This module imports neither torch nor the runtime: the CLI asks `is_torchrun_script` before anything starts.
"""

from __future__ import annotations

import builtins
import json
import os
import sys
import time
import types
from typing import Any

from elasticd.agent.comm import beat
from elasticd.agent.compat import per_rank_main, per_rank_singletons
from elasticd.agent.slicer.context import runtime_of, worker_of
from elasticd.core.env_names import ARGS_VAR, STEP_OFFSET_VAR
from elasticd.core.errors import JobError


class ScriptExit(JobError, RuntimeError):
    """The script called `sys.exit` with a failure status in a worker (torchrun would see that process fail)."""


def script_args(environ: Any = None) -> list[str]:
    raw = (os.environ if environ is None else environ).get(ARGS_VAR, "")
    if not raw:
        return []
    args = json.loads(raw)
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError(f"{ARGS_VAR} must be a JSON list of strings, got {raw!r}")
    return args


class ScriptMain:
    """The stand-in for an `ElasticFunction` that a torchrun-mode script gives the agent.

    `fn(ctx)` is what each logical worker runs: the script as `__main__`, start to end. A worker that
    returns is done; `sys.exit(0)` (or `None`) is a normal end, any other status fails the job like an
    exception, with the worker's rank.
    """

    deterministic = False
    torchrun = True

    def __init__(self, path: str, args: list[str]) -> None:
        self.path = os.path.abspath(path)
        with open(self.path, encoding="utf-8") as f:
            self.source = f.read()
        self._compile()  # a SyntaxError fails the agent here, before any worker starts
        self.args = list(args)
        script_dir = os.path.dirname(self.path)
        if script_dir not in sys.path:
            sys.path.insert(0, script_dir)  # `from datautils import ...` next to the script, as `python script.py`
        sys.argv = [self.path, *self.args]  # read-only for the workers: argparse parses it once per worker
        per_rank_singletons.install()  # @hydra.main's run state, per worker as it is per process
        per_rank_main.install()        # pickle finds the script's classes as `__main__.Name`, as under torchrun

    def fn(self, ctx: Any) -> None:
        worker = worker_of(ctx)
        worker.dist.initialized = False  # a torchrun script initializes its process group itself
        runtime = runtime_of(ctx)
        counter = StepCounter(runtime, worker) if ctx.rank == runtime.hosted[0] else None
        fresh_streams()
        module = types.ModuleType("__main__")
        module.__dict__.update(__file__=self.path, __builtins__=builtins, __spec__=None, __loader__=None,
                               __cached__=None)
        worker.dist.main_module = module
        try:
            exec(self._compile(), module.__dict__)
        except SystemExit as e:
            if e.code not in (None, 0):
                raise ScriptExit(f"the script called sys.exit({e.code!r})") from e
        finally:
            worker.dist.main_module = None
            if counter is not None:
                counter.remove()

    def _compile(self) -> types.CodeType:
        """The script's code, compiled anew for each worker, as each torchrun process compiles its own.

        Shared code objects would tie the ranks' namespaces together: torch.compile caches its compiled
        frames on the code object and installs the callable they name in the globals of the rank that
        compiled them, so another rank reusing the cache entry found no such name (`NameError:
        __compiled_fn_9_...`, modded-nanogpt's `@torch.compile` Newton-Schulz).
        `dont_inherit`: this module's `from __future__ import annotations` must not reach the script.
        """
        return compile(self.source, self.path, "exec", dont_inherit=True)


def fresh_streams() -> None:
    """Seed the calling worker's `random` and numpy streams from the OS, as a process torchrun starts has them.

    Under torchrun every rank of a script that never seeds draws numbers of its own (synthetic batches,
    dropout masks, a `random_split`). The runtime gives each worker streams of its own where nothing in the
    agent seeded or drew from the process's before the run (agent/slicer/rng.py); a torchrun-mode worker
    is a fresh process whatever the agent did, so its `random` and numpy are reseeded here too. torch's
    the runtime decides from its seed alone, which draws leave alone.
    """
    from elasticd.agent.slicer import rng  # here, not at the top: the CLI imports this module before torch

    rng.seed_from_os(rng.Unseeded(torch=False, python=True, numpy=True))


class StepCounter:
    """A torchrun script has no step boundaries: its steps, for progress and `--scale-at`, are logical rank
    0's optimizer steps, what a user counts as iterations (a backward pass per micro-batch would count an
    iteration with gradient accumulation several times). Each agent counts its first hosted worker's, in
    step with rank 0's, and reports them with its timing, as a step boundary does. Only the first optimizer
    the worker steps counts, so that a GAN's two optimizers make one step per iteration; until the worker
    has made an optimizer (a script that updates its parameters by hand never does) its backward passes
    count instead. The count goes on across restarts (the launcher passes it on, STEP_OFFSET_VAR): steps a
    restarted script does again count again, so the schedule of `--scale-at` only moves forward.

    After a step the launcher scheduled a resize at, the agent stops there (the worker holds the baton, so
    every worker of the job stops within one step) and waits to be restarted at the new size: the step the
    script's own checkpoint resumes from is then what the restart costs, as under torchrun. Counted through
    torch's public global optimizer hook, removed when the script ends."""

    def __init__(self, runtime: Any, worker: Any) -> None:
        import weakref

        from torch.optim.optimizer import Optimizer, register_optimizer_step_post_hook

        from elasticd.agent.worker import current_worker

        self._rt = runtime
        self._worker = worker
        self._current = current_worker
        self._first: weakref.ref[Any] | None = None
        self._ref = weakref.ref
        self.step = int(os.environ.get(STEP_OFFSET_VAR, "0"))
        self._handle = register_optimizer_step_post_hook(self._stepped)
        self._optimizer = Optimizer
        worker.turn.backward_hooks.append(self._backward)

    def remove(self) -> None:
        self._handle.remove()

    def _backward(self) -> None:
        if not any(isinstance(o, self._optimizer) for o in self._worker.capture.created):
            self()

    def _stepped(self, opt: Any, args: Any, kwargs: Any) -> None:
        if self._current() is not self._worker:
            return   # another rank's optimizer, or one stepped outside the workers
        if self._first is None or self._first() is None:
            self._first = self._ref(opt)
        elif self._first() is not opt:
            return
        self()

    def __call__(self) -> None:
        self.step += 1
        # After a restart (a daemon's recovery) the boundary holds the step elasticd restarted the job at: 0
        # for a torchrun script, whose checkpoint decides what it skips. Reported with every step, as an
        # @elastic job's boundary does, so that the scheduler records the recovery once the job steps.
        resumed = self._rt.boundary.resumed_from
        self._rt.timing.boundary(time.perf_counter())   # compute vs collective seconds, as a step boundary keeps
        beat.stepped(self.step)
        held = self.step in self._rt.boundary.hold_at
        self._rt.control.step(self.step, {} if resumed is None else {"resumed_from": resumed}, self._rt.timing.take(),
                              held=held)
        if held:
            self._hold()

    def _hold(self) -> None:
        # The launcher stops this process once every agent is held or gone; a stop command or the
        # launcher's death ends it too (the control channel has no blocking read: poll gently).
        parent = os.getppid()
        while os.getppid() == parent:
            if any(type(cmd).__name__ == "AgentStop" for cmd in self._rt.control.poll()):
                break
            time.sleep(0.02)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
