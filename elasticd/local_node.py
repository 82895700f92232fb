"""`elasticd run` on the daemon's node and scheduler cores: one lifecycle for a run and a cluster.

One process: a NodeDaemon with its embedded scheduler on a private state dir (elasticd.run_dirs), serving
this run's devices only, and a client that submits the job and follows it, saying what happens in the
run's own words; the agents write to this process's stdout and stderr. Resizes, recoveries, the watchdog
and torchrun-mode restarts are the node's and the scheduler's, as for `elasticd submit`.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticd import protocol as p
from elasticd import transport
from elasticd.control_client import Client, Target
from elasticd.core import parts
from elasticd.core.failures import Cause
from elasticd.core.lifecycle import JOB_ENDED, ResizeOutcome, ResizePhase
from elasticd.core.text import say
from elasticd.core.timing import clean_timing, merge_timing
from elasticd.core.watchdog import fence_said
from elasticd.daemon import job_user
from elasticd.daemon.server import DaemonConfig, NodeDaemon
from elasticd.run_dirs import private_dir, tmpfs_root
from elasticd.scheduler.jobs import JobState
from elasticd.scheduler.resizing import RELEASE_WHY
from elasticd.statedir import StateDir

# How often the run reads its job's record (what it says and when it ends) and how often its node reports to
# its scheduler. Both are hops between the run's threads: at 0.05 s and 0.1 s they took 8% of a core, and the
# threads' turns at the GIL showed in every resize's pause (4 -> 2 -> 4 agents on 2 cores: 0.23 / 0.27 s against
# 0.21 / 0.25 s at these). Every event a decision waits on (a held step, a resize done, an agent gone) goes
# to the scheduler at once whatever the heartbeat, and the watchdog reads agents on its own clock.
POLL_S = 0.25
HEARTBEAT_S = 0.25


# The node's and scheduler's own log lines are a daemon operator's; a run says what happens in its own words.
QUIET_LOGGERS = ("elasticd.daemon", "elasticd.scheduler", "elasticd.forked", "elasticd.resize_plan")


@dataclass(frozen=True)
class RunStateDir(StateDir):
    """A run's node keeps its state and its agents' area in directories of this run's (swept once the run is
    gone, `elasticd.run_dirs`), and the snapshots where --snapshot-dir says, if it says."""

    agents: Path = Path()
    snapshots: Path | None = None

    @property
    def agent_root(self) -> Path:
        return self.agents

    def snapshot_dir(self, job_id: str) -> Path:
        return self.snapshots or self.job_dir(job_id)


class LocalNode:
    def __init__(self, devices: int, device_type: str, snapshot_dir: str = "") -> None:
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        self.sd = RunStateDir(Path(private_dir(tempfile.gettempdir())), agents=Path(private_dir(tmpfs_root())),
                              snapshots=Path(snapshot_dir) if snapshot_dir else None)
        # The run's own devices: on CUDA the ones it checked (`elasticd run` refuses more agents than GPUs,
        # but for the gloo test switch that lets several share one), not a probe of the machine's.
        cfg = DaemonConfig(state_dir=self.sd, cpu_devices=devices if device_type == "cpu" else None,
                           cuda_devices=devices if device_type == "cuda" else None,
                           heartbeat_s=HEARTBEAT_S, relayout=False, jobs_as=job_user.own().name, inherit_output=True,
                           pin_by_rank=device_type == "cpu")
        self.daemon = NodeDaemon(cfg)
        self.thread = threading.Thread(target=self.daemon.run, name="elasticd-node", daemon=True)
        self.thread.start()
        self.client = Client(Target(transport.ipc_endpoint(self.sd.daemon_sock)), timeout_s=30.0)

    def close(self) -> None:
        self.client.close()
        self.daemon.stop()
        self.thread.join(30)
        shutil.rmtree(self.sd.root, ignore_errors=True)
        shutil.rmtree(self.sd.agents, ignore_errors=True)
        if self.sd.snapshots is not None:   # the user's: only what the agents wrote goes
            for d in parts.written(self.sd.snapshots):
                shutil.rmtree(d, ignore_errors=True)


def _say(text: str) -> None:
    say(f"[elasticd] {text}")


def run_on_node(submit: p.Submit, devices: int, device_type: str, summary: str | None, snapshot_dir: str = "") -> int:
    node = LocalNode(devices, device_type, snapshot_dir)
    try:
        job_id = node.client.request(submit).job_id   # type: ignore[attr-defined]
        shell = _Shell(torchrun=submit.torchrun)
        while True:
            info = node.client.request(p.Status(job_id=job_id)).jobs[0]   # type: ignore[attr-defined]
            shell.follow(info)
            if info.state in JOB_ENDED:
                break
            time.sleep(POLL_S)
        for rank, t in sorted(shell.timing.items()):
            if t.get("hosted"):
                _say(f"agent {rank}: {t['hosted']} worker(s), compute {t['compute_s']:.4f}s/step "
                     f"({t['compute_s'] / t['hosted']:.4f}s per worker), collectives {t['flush_s']:.4f}s/step, "
                     f"over {t['steps']} step(s)")
        code = _verdict(info) if info.state == JobState.FINISHED.value else 1
        if info.error and (info.error.get("cause") != Cause.USER.value or "traceback" not in info.error):
            _say(str(info.error.get("message", "")))   # not a worker's own error, which its agent printed already
        if summary:
            refused = [r for r in info.resizes if not r.note.startswith(DROPPED)]
            with open(summary, "w") as f:
                json.dump({"exit": code, "last_step": info.step, "devices": info.devices, "blocks": info.blocks,
                           "resizes": [r.to_dict() for r in refused],
                           "recoveries": [r.to_dict() for r in info.recoveries],
                           "agents": {str(rank): t for rank, t in sorted(shell.timing.items())}},
                          f, indent=1)
        return code
    finally:
        node.close()


DROPPED = "dropped: "   # the note of a --scale-at entry dropped with a refusal (Job.drop_schedule)


class _Shell:
    """Says what happens to the run as `elasticd run` words it, from the job's record as the node's
    scheduler keeps it (resizes, recoveries, lifecycle history)."""

    def __init__(self, torchrun: bool) -> None:
        self.torchrun = torchrun
        self.resizes = 0        # entries said
        self.restarting = -1    # a torchrun-mode restart said, by its entry's index
        self.recoveries = 0
        self.history = 0
        self.told = -1          # the epoch of the last go said
        self.last_print = 0.0
        self.timing: dict[int, dict[str, Any]] = {}   # rank -> its agent's step timing over the run
        self._seq: dict[int, int] = {}                 # rank -> the last published timing merged

    def follow(self, info: p.JobInfo) -> None:
        for a in info.agents:
            seq = a.timing.get("seq")
            if not a.timing.get("hosted") or not isinstance(seq, int) or self._seq.get(a.rank) == seq:
                continue
            self._seq[a.rank] = seq
            report = clean_timing(a.timing)
            seen = self.timing.get(a.rank)   # a resize that renumbers agents starts a rank's record over
            self.timing[a.rank] = merge_timing(seen if seen and seen["hosted"] == report["hosted"] else None, report)
        for _at, state, reason in info.history[self.history:]:
            self.history += 1
            self._lifecycle(state, reason, info)
        rs = info.resizing
        if (rs is not None and rs.phase == ResizePhase.GO.value and rs.epoch != self.told
                and not rs.why.startswith(RELEASE_WHY)):
            self.told = rs.epoch
            _say(f"resize {rs.src} -> {rs.dst} devices: agents told to hand over at their next step boundary")
        self._resizes(info)
        for rec in info.recoveries[self.recoveries:]:
            self.recoveries += 1
            if not self.torchrun:
                held = (f"; the stuck agent had held the job {rec.detected_after:.1f}s before it was fenced"
                        if rec.detected_after else "")
                _say(f"recovered: resumed at step {rec.resumed_from} ({rec.steps_redone} step(s) redone), first "
                     f"step {rec.seconds or 0:.2f}s after the failure was detected{held}")
            else:
                _say(f"restarted on {rec.devices} device(s): first step {rec.seconds or 0:.2f}s after the request")
        now = time.monotonic()
        if info.state == JobState.RUNNING.value and now - self.last_print >= 2.0:
            self.last_print = now
            shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.metrics.items()
                             if k != "resumed_at")
            counted = "optimizer step" if self.torchrun else "step"
            _say(f"{counted} {info.step} on {info.devices} device(s) {shown}".rstrip())

    def _lifecycle(self, state: str, reason: str, info: p.JobInfo) -> None:
        # Said from the history, which keeps every transition, not from `resizing`, which a read may miss.
        if state == JobState.RESIZING.value and reason.startswith(RELEASE_WHY):
            step = reason.removeprefix(RELEASE_WHY).split(":")[0]
            if not any(r.outcome == ResizeOutcome.REFUSED.value and str(r.step) == step for r in info.resizes):
                _say(f"scale to {info.devices} devices: already there, nothing to do")
        elif state == JobState.RECOVERING.value:
            fenced = fence_said(reason)
            if fenced:
                _say(fenced)
        elif state == JobState.STARTING.value and "restarting" in reason and "failed half-way" not in reason:
            _say(reason)

    def _resizes(self, info: p.JobInfo) -> None:
        for i, r in enumerate(info.resizes[self.resizes:], start=self.resizes):
            if r.outcome in (ResizeOutcome.PENDING.value, ResizeOutcome.RESTARTING.value):
                break
            self.resizes += 1
            if r.outcome == ResizeOutcome.DONE.value:
                _say(f"resized {r.src} -> {r.dst} devices after step {r.step} in {r.seconds or 0:.2f}s "
                     f"(training paused {r.stall or 0:.2f}s)")
            elif r.outcome == ResizeOutcome.RESTARTED.value:
                _say(f"restarted on {r.dst} device(s): first step {r.seconds or 0:.2f}s after the request")
            elif r.outcome == ResizeOutcome.REFUSED.value and r.note.startswith(DROPPED):
                continue   # said with the refusal that dropped it
            elif r.outcome == ResizeOutcome.REFUSED.value:
                dropped = [x.why.removeprefix("--scale-at ") for x in info.resizes[i + 1:]
                           if x.note.startswith(DROPPED)]
                _say(f"resize {r.src} -> {r.dst} devices after step {r.step} refused, the job goes on on "
                     f"{r.src} device(s)" + (f"; --scale-at {','.join(dropped)} dropped" if dropped else "")
                     + f": {r.note}")
            elif r.outcome == ResizeOutcome.ROLLED_BACK.value:
                # The note: "resize E (A -> B devices, WHY) failed: CAUSE; restarted on its A devices from ..."
                cause = r.note.split("; restarted on its ")[0].split(") failed: ", 1)[-1]
                _say(f"{cause} during the resize {r.src} -> {r.dst}; restarting on {r.src} devices from the "
                     f"snapshot saved at its step boundary")
            else:
                _say(f"resize {r.src} -> {r.dst} devices after step {r.step} {r.outcome}: {r.note}")


def _verdict(info: p.JobInfo) -> int:
    """The exit code of a job that finished: 1 if its agents refused a --scale-at resize, or if it never
    reached a step boundary while --scale-at asked for resizes (they could not happen), else 0."""
    refused = "; ".join(f"{r.step}:{r.dst}: {r.note}" for r in info.resizes
                        if r.outcome == ResizeOutcome.REFUSED.value and not r.note.startswith(DROPPED))
    if refused:
        say(f"[elasticd] error: --scale-at refused ({refused}). The job trained on at its size from there; its "
            "result is what its N workers compute, but the resizes asked for did not happen")
        return 1
    left = [f"{e.step}:{e.devices}" for e in info.scale_at] + [
        f"{r.step}:{r.dst}" for r in info.resizes if r.outcome == ResizeOutcome.NOT_APPLIED.value]
    if not left:
        return 0
    if "total_steps" not in info.metrics:
        say(f"[elasticd] error: --scale-at {','.join(left)} refused: the function never reached a step "
            f"boundary of `ctx.steps`, the only place a job can be resized. Its result is what it computed "
            f"on {info.devices} device(s). To resize it, drive its loop with `for step in ctx.steps(n)`")
        return 1
    _say(f"--scale-at {','.join(left)} not applied: the job ended after step {info.step}, "
         f"before reaching {'them' if len(left) > 1 else 'it'}")
    return 0
