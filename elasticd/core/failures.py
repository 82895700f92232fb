"""Why an agent, and so its job, failed: named once for the agent that reports it, the supervisors that see
it end (the node daemon, `elasticd run`) and the scheduler that decides what follows.

Only the user's own error is final: retrying a script that raised would fail the same way. Every other
cause is the infrastructure's doing, and the job restarts from its newest complete snapshot instead
(within --max-restarts): elasticd/scheduler/recovery.py, on a cluster and under `elasticd run`, whose node
and scheduler run in its own process (elasticd/local_node.py).
"""

from __future__ import annotations

import signal
from enum import Enum


class Cause(str, Enum):
    """An agent's failure cause, as its error report and the job's recovery record carry it (the value)."""

    USER = "user"            # the script raised or cannot load: retrying cannot help
    PEER_LOST = "peer_lost"  # another agent died under this one: the job can be recovered
    DIED = "died"            # it ended without saying why: a signal, the OOM killer, a crash in native code
    STUCK = "stuck"          # its supervisor's watchdog fenced it (elasticd/core/watchdog.py)
    NODE_LOST = "node_lost"  # its node stopped heartbeating
    DRAINED = "drained"      # its node was drained and the job could not move off it in time


# The causes a job is recovered from. A tuple: members compare equal to their values, which a set lookup
# would not find (an Enum hashes by name).
INFRASTRUCTURE = tuple(c for c in Cause if c is not Cause.USER)


def is_infrastructure(cause: str | None) -> bool:
    """Whether a failure of this cause is the infrastructure's, so the job restarts instead of failing."""
    return cause in INFRASTRUCTURE


def no_restart(cause: str, used: int, limit: int) -> str:
    """Why a job whose failure is the infrastructure's is not restarted: its --max-restarts are used up."""
    return f"{cause}; not restarting: {used} restart(s) of --max-restarts {limit} used"


def how_it_ended(code: int) -> str:
    """An agent's exit status as subprocess gives it, in words: 'was killed by SIGKILL' (-9), 'was killed by
    signal 40' (a real-time signal, which has no name of its own), 'exited with code 3'."""
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"
