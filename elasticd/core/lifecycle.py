"""The named states a resize goes through, shared by the scheduler, the daemon and `elasticd run`."""

from __future__ import annotations

from enum import Enum


class ResizePhase(str, Enum):
    """Where one resize stands (elasticd/resize_plan.py)."""

    PREPARE = "prepare"    # joiners start and report ready; nothing has changed yet
    GO = "go"              # every agent was told the new layout; waiting for them to say they resized
    REFUSED = "refused"    # the agents refused it (state they cannot carry): the job trains on at its size
    ROLLBACK = "rollback"  # it failed after the go: the job restarts from its fall-back snapshot


class ResizeOutcome(str, Enum):
    """How a resize ended, as the job's history and its events name it (stored and sent as the value)."""

    PENDING = "pending"          # `elasticd run`: asked for, not ended yet
    DONE = "done"
    REFUSED = "refused"          # the agents refused it (state they cannot carry): the job trains on at its size
    ABORTED = "aborted"          # called off before the go (a joiner did not start in time)
    NOT_APPLIED = "not applied"  # the job ended before the hand-over
    FAILED = "failed"            # the job failed during the hand-over
    ROLLED_BACK = "rolled back"  # failed after the go: restarted from the fall-back snapshot
    RESTARTING = "restarting"    # torchrun mode: the job is restarted at the new size
    RESTARTED = "restarted"


# Outcomes after which the job ran at the new size: live, or restarted there (a torchrun-mode job). A tuple:
# members compare equal to their values, which a set lookup would not find (an Enum hashes by name).
TOOK_EFFECT = (ResizeOutcome.DONE, ResizeOutcome.RESTARTED)


# The states a job ends in (elasticd.scheduler.jobs.JobState's values): what every reader of a job's state
# (status, logs -f, submit --wait, events -f, the metrics and the status page) stops at.
JOB_ENDED = ("finished", "failed", "stopped")
