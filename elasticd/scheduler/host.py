"""What the scheduler's resize shells (`resizing`, `rollback`) may ask of the state that holds them.

`SchedulerState` owns the job and node tables; the resize shells are objects it holds, not mixins of it,
and this is all they see of it: the tables, the config, and the four verbs a resize needs (end a job,
kill its agents on a node, launch it on a node, free devices). Keeping it small keeps the shells
testable and shows at a glance what a resize can do to the rest of the island.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from elasticd.placement import policy
from elasticd.scheduler.actions import SendToNode
from elasticd.scheduler.jobs import Job, JobState

if TYPE_CHECKING:   # annotations only (as in the shells): state.py is what implements this
    from elasticd.placement.speeds import Speeds
    from elasticd.scheduler.state import Config, Node


class ResizeHost(Protocol):
    cfg: Config
    jobs: dict[str, Job]
    nodes: dict[str, Node]
    speeds: Speeds   # the cost model: block sizes of a new layout

    def changed(self, job: Job, *, resched: bool = False) -> None:
        """Persist `job`; `resched`: devices were freed or reserved, so run the placement again."""

    def free_views(self) -> list[policy.NodeView]:
        """Live nodes with their free devices, for the policy."""

    def end_job(self, job: Job, dst: JobState, now: float, reason: str, *, error: dict[str, Any] | None = None,
                gone: str | None = None) -> list[SendToNode]:
        """Leave an active state for `dst`, killing agents wherever they may still run (not on `gone`)."""

    def kill(self, node: str, job_id: str, now: float, reason: str, force: bool = False,
             hard: bool = False) -> list[SendToNode]:
        """Tell `node` to kill the job's agents (`hard`: no stop command first)."""

    def takes_work(self, node: str) -> bool:
        """Whether `node` may be given work (not being drained)."""

    def launch(self, job: Job, node: str) -> SendToNode:
        """Start the job's agents of `node` as its placement says."""
