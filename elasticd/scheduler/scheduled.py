"""Resizes at exact steps (`elasticd submit --scale-at STEP:M,...`), the scheduler's half.

The agents are launched knowing the steps of the schedule still to come (`Job.hold_at`, sent in
`LaunchJob.hold_at` and, for joiners, `PrepareResize.hold_at`): at each such step boundary every agent
votes for a resize and waits for its command, so a resize asked for "after step 10" happens after step
10 however late the scheduler hears of it. Once rank 0's node reports the job at or past the entry's
step, the scheduler starts that resize as `elasticd scale` would. When it cannot -- a grow with too few
free devices, or a layout the job has already -- the held agents are released by a resize to the layout
they have (nothing moves: the agents' `_relayout` keeps every worker where it is); a refused grow is
recorded in the job's resize history. A scheduled resize called off before its go (a joiner died) is
followed by a release too, since the agents were held for it.

A grow is prepared ahead: once the job's reported rate puts its step within PREPARE_AHEAD_S and the devices
are free and no job waits for devices, the resize begins with its go deferred to the step
(`ResizePlan.after_step`), so the joiners start and warm up while the job trains, and the agents held after
the step hand over at once. Called off before the step (a joiner failed, a drain moves the job, a job
submitted meanwhile waits for devices), the entry is handled at the step as if it had not been prepared.

A torchrun-mode job counts its optimizer steps (agent/script_main.py) and its agents stop for good at a
held step: each resize there is a restart at the new size (elasticd.scheduler.recovery), and so is its
release, at the size it has, since a stopped script cannot go on in place.

The agents drop their held steps when they refuse a resize (a state they cannot carry): the rest of the
schedule is dropped with them (`Job.drop_schedule`), as `elasticd run` does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from elasticd.placement.speeds import sizes
from elasticd.protocol import ScaleAt
from elasticd.scheduler.actions import SendToNode
from elasticd.scheduler.host import ResizeHost
from elasticd.scheduler.jobs import Job, JobState, scale_at_why
from elasticd.scheduler.resizing import Resizes

log = logging.getLogger(__name__)

# How far ahead of its step, at the job's reported rate, a scheduled grow starts its joiners: a joiner's
# warm-up (the script imported, CUDA initialised) takes well under this on a spare, and the devices are
# held for the job no longer than that before the step.
PREPARE_AHEAD_S = 10.0


class ScheduledScales:
    def __init__(self, host: ResizeHost, resizes: Resizes, free_count: Callable[[], int],
                 queued: Callable[[], list[Job]]) -> None:
        self.host = host
        self.resizes = resizes
        self.free_count = free_count   # devices free for a grow now
        self.queued = queued           # jobs waiting to start: free devices are theirs before a grow's ahead of time

    def due(self, job: Job, now: float, refused: tuple[int, str] | None = None) -> list[SendToNode]:
        """Start the job's next scheduled resize if its step has come (a grow: prepare it once the step is
        near), or release agents held for one that did not happen. Only between resizes and recoveries: a
        resize in flight goes first, unless it is the grow prepared ahead of the step the job is at now.

        `refused`: (step, why) where rank 0's node reports that the agents refused at a held step with no
        resize begun yet (they stop after it and try to capture before the scheduler hears of the step):
        the entry of that step is refused, and the schedule dropped, without a resize."""
        plan = job.resize
        if job.grow_ahead and plan is not None and job.step >= plan.after_step:
            return self.resizes.reached(job, now)
        if job.state is not JobState.RUNNING or job.resize is not None or job.recovery is not None:
            return []
        schedule = job.spec.scale_at
        if job.scheduled < len(schedule) and job.step >= schedule[job.scheduled].step:
            e = schedule[job.scheduled]
            if refused is not None and refused[0] == e.step:
                return self._refused_at_hold(job, e, refused[1], now)
            job.scheduled += 1
            if job.step == e.step:
                job.held = e.step   # every agent voted to stop after it: they wait for a command
            self.host.changed(job)
            why, target, current = scale_at_why(e), e.devices, len(job.placement)
            workers = job.spec.workers
            same = target == current and (not e.blocks or sizes(e.blocks, workers, target)
                                          == sizes(job.blocks, workers, current))
            if same:
                log.info("job %s: %s: the job has that layout already", job.job_id, why)
            else:
                free = self.free_count()
                if target - current <= free:
                    job.requested_devices = target
                    log.info("job %s: %s: resizing %d -> %d devices", job.job_id, why, current, target)
                    return self.resizes.begin(job, target, why, now, blocks=list(e.blocks) or None)
                note = f"{free} device(s) free after step {e.step}, {target - current} more needed"
                job.refuse_scheduled(e, note, now)
                log.warning("job %s: %s refused: %s", job.job_id, why, note)
        if job.held is not None:
            held, job.held = job.held, None
            self.host.changed(job)
            return self.resizes.begin_release(job, held, now)
        return self._ahead(job, now)

    def _refused_at_hold(self, job: Job, e: ScaleAt, why: str, now: float) -> list[SendToNode]:
        job.refuse_scheduled(e, why, now)
        job.scheduled += 1
        job.drop_schedule(why, now)   # the agents dropped the steps they were to hold after, and train on
        self.host.changed(job)
        log.warning("job %s: %s refused by its agents at the held step: %s", job.job_id, scale_at_why(e), why)
        return []

    def _ahead(self, job: Job, now: float) -> list[SendToNode]:
        """Prepare the next scheduled entry now if it is a grow the job is expected to reach within
        PREPARE_AHEAD_S at its reported rate, and the devices are free: its joiners start and warm up (script
        loaded, CUDA up) while the job trains on, and the hand-over begins as soon as the agents hold after
        the step, as under `elasticd run`, whose standby agents are started with the job. The devices are
        the job's from now on; a grow the free devices cannot take is left to its step (refused there)."""
        schedule = job.spec.scale_at
        if job.spec.torchrun or job.scheduled >= len(schedule):
            return []
        e = schedule[job.scheduled]
        current = len(job.placement)
        if e.devices <= current or job.step >= e.step or job.steps_per_s <= 0 or job.prepared == e.step:
            return []   # a grow prepared ahead and called off is not tried ahead again: its step handles it
        if (e.step - job.step) / job.steps_per_s > PREPARE_AHEAD_S or e.devices - current > self.free_count():
            return []
        if self.queued():
            return []   # their placement goes first; the grow is handled at its step
        job.scheduled += 1
        job.prepared = e.step
        why = scale_at_why(e)
        job.requested_devices = e.devices
        log.info("job %s: %s: preparing the grow %d -> %d devices ahead (at step %d)", job.job_id, why, current,
                 e.devices, job.step)
        return self.resizes.begin(job, e.devices, why, now, blocks=list(e.blocks) or None, after_step=e.step)
