"""Resizing and recovering a torchrun-mode job under `elasticd run`: stop every agent, start them again.

A torchrun script has no step boundary at which its state could be carried over (agent/script_main.py):
what it keeps is its own checkpoint. So, as torchrun's elastic agent does on a membership change or a
failed worker, a resize stops the whole job and starts it again at the new size, and the script resumes
from its checkpoint; the steps since that checkpoint are computed again. An agent that dies without
an error report (killed, out of memory), or whose group failed because another one died, restarts the job
at its size, at most `--max-restarts` times; a worker that raised fails the job at once, as under torchrun.
"""

from __future__ import annotations

from typing import Any

from elasticd.core.env_names import RESTARTS_VAR, STEP_OFFSET_VAR
from elasticd.core.failures import no_restart
from elasticd.ports import free_port


def relaunch(job: Any, step: int, target: int) -> None:
    """Stop every agent of `job` (the launcher's `LocalRun`), then start `target` new ones that count steps on from `step`."""
    job._read(0)
    job.stop_all()   # synchronous: no agent of the job runs once it returns
    job._forget_agents()
    job.world = target
    job.restarts += 1
    job.env = {**(job.env or {}), RESTARTS_VAR: str(job.restarts), STEP_OFFSET_VAR: str(max(step, 0))}
    port = free_port()
    for rank in range(target):
        job._spawn(rank, target, port)


def recoverable(job: Any, bad: Any) -> str | None:
    """An agent exited badly: why (in the words a recovery of an @elastic job uses) if the job may restart at
    its size (an infrastructure failure, no worker reported an error, recoveries left); None if it fails (a
    worker raised, or too many recoveries)."""
    cause = job._infrastructure_cause(bad)   # None: a worker raised (the survivors' lost groups do not count)
    if cause is None:
        return None
    if job.torchrun_recoveries >= job.max_restarts:
        job._say(no_restart(cause, job.torchrun_recoveries, job.max_restarts))
        return None
    job.torchrun_recoveries += 1
    return cause
