"""`elasticd run` on the daemon's node and scheduler cores (prototype on this branch).

One process: a NodeDaemon with its embedded scheduler on a private state dir, serving this run's devices
only, and a client that submits the job and says what it does; the agents write to this process's stdout
and stderr.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

from elasticd import protocol as p
from elasticd import transport
from elasticd.cli.client import Client, Target
from elasticd.core.lifecycle import JOB_ENDED, ResizeOutcome, ResizePhase
from elasticd.daemon import job_user
from elasticd.daemon.server import DaemonConfig, NodeDaemon
from elasticd.scheduler.jobs import JobState
from elasticd.statedir import StateDir

POLL_S = 0.05


# The node's and scheduler's own log lines are a daemon operator's; a run says what happens in its own words.
QUIET_LOGGERS = ("elasticd.daemon", "elasticd.scheduler", "elasticd.forked", "elasticd.resize_plan")


class LocalNode:
    def __init__(self, devices: int, device_type: str) -> None:
        for name in QUIET_LOGGERS:
            logging.getLogger(name).setLevel(logging.ERROR)
        self.root = Path(tempfile.mkdtemp(prefix=f"elasticd-node-{os.getpid()}-"))
        self.sd = StateDir(self.root)
        cfg = DaemonConfig(state_dir=self.sd, cpu_devices=devices if device_type == "cpu" else None,
                           heartbeat_s=0.1, relayout=False, jobs_as=job_user.own().name, inherit_output=True,
                           pin_by_rank=device_type == "cpu")
        self.daemon = NodeDaemon(cfg)
        self.thread = threading.Thread(target=self.daemon.run, name="elasticd-node", daemon=True)
        self.thread.start()
        self.client = Client(Target(transport.ipc_endpoint(self.sd.daemon_sock)), timeout_s=30.0)

    def close(self) -> None:
        self.client.close()
        self.daemon.stop()
        self.thread.join(30)
        shutil.rmtree(self.root, ignore_errors=True)


def _say(text: str) -> None:
    print(f"[elasticd] {text}", file=sys.stderr, flush=True)


def run_on_node(submit: p.Submit, devices: int, device_type: str, summary: str | None) -> int:
    node = LocalNode(devices, device_type)
    try:
        job_id = node.client.request(submit).job_id   # type: ignore[attr-defined]
        said_resizes = 0
        said_recoveries = 0
        told = -1
        last_print = 0.0
        while True:
            info = node.client.request(p.Status(job_id=job_id)).jobs[0]   # type: ignore[attr-defined]
            rs = info.resizing
            if rs is not None and rs.phase == ResizePhase.GO.value and rs.epoch != told:
                told = rs.epoch
                if rs.src == rs.dst and rs.why.startswith("--scale-at") and rs.why.count(":") == 1:
                    _say(f"scale to {rs.dst} devices: already there, nothing to do")
                else:
                    _say(f"resize {rs.src} -> {rs.dst} devices: agents told to hand over at their next step "
                         "boundary")
            for r in info.resizes[said_resizes:]:
                if r.outcome == ResizeOutcome.PENDING.value:
                    break
                said_resizes += 1
                if r.outcome == ResizeOutcome.DONE.value:
                    _say(f"resized {r.src} -> {r.dst} devices after step {r.step} in {r.seconds or 0:.2f}s "
                         f"(training paused {r.stall or 0:.2f}s)")
                elif r.outcome == ResizeOutcome.REFUSED.value:
                    _say(f"resize {r.src} -> {r.dst} devices after step {r.step} refused, the job goes on on "
                         f"{r.src} device(s): {r.note}")
                else:
                    _say(f"resize {r.src} -> {r.dst} devices after step {r.step} {r.outcome}: {r.note}")
            for rec in info.recoveries[said_recoveries:]:
                said_recoveries += 1
                _say(f"recovered: {rec.to_dict()}")
            now = time.monotonic()
            if info.state == JobState.RUNNING.value and now - last_print >= 2.0:
                last_print = now
                shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in info.metrics.items())
                _say(f"step {info.step} on {info.devices} device(s) {shown}".rstrip())
            if info.state in JOB_ENDED:
                break
            time.sleep(POLL_S)
        for a in sorted(info.agents, key=lambda a: a.rank):
            t = a.timing
            if t.get("hosted"):
                _say(f"agent {a.rank}: {t['hosted']} worker(s), compute {t['compute_s']:.4f}s/step, "
                     f"collectives {t['flush_s']:.4f}s/step, over {t['steps']} step(s)")
        code = _verdict(info) if info.state == JobState.FINISHED.value else 1
        if info.error:
            _say(f"job {info.state}: {info.error.get('message', '')}")
            if info.error.get("traceback"):
                print(info.error["traceback"], file=sys.stderr, flush=True)
        if summary:
            with open(summary, "w") as f:
                json.dump({"exit": code, "last_step": info.step, "devices": info.devices, "blocks": info.blocks,
                           "resizes": [r.to_dict() for r in info.resizes],
                           "recoveries": [r.to_dict() for r in info.recoveries], "agents": {}}, f, indent=1)
        return code
    finally:
        node.close()


def _verdict(info: p.JobInfo) -> int:
    """The exit code of a job that finished: 1 if its agents refused a --scale-at resize, or if it never
    reached a step boundary while --scale-at asked for resizes (they could not happen), else 0."""
    refused = "; ".join(f"{r.step}:{r.dst}: {r.note}" for r in info.resizes if r.outcome == ResizeOutcome.REFUSED.value)
    if refused:
        print(f"[elasticd] error: --scale-at refused ({refused}). The job trained on at its size from there; its "
              "result is what its N workers compute, but the resizes asked for did not happen",
              file=sys.stderr, flush=True)
        return 1
    left = [f"{e.step}:{e.devices}" for e in info.scale_at] + [
        f"{r.step}:{r.dst}" for r in info.resizes if r.outcome == ResizeOutcome.NOT_APPLIED.value]
    if not left:
        return 0
    if "total_steps" not in info.metrics:
        print(f"[elasticd] error: --scale-at {','.join(left)} refused: the function never reached a step "
              f"boundary of `ctx.steps`, the only place a job can be resized. Its result is what it computed "
              f"on {info.devices} device(s). To resize it, drive its loop with `for step in ctx.steps(n)`",
              file=sys.stderr, flush=True)
        return 1
    _say(f"--scale-at {','.join(left)} not applied: the job ended after step {info.step}, "
         f"before reaching {'them' if len(left) > 1 else 'it'}")
    return 0
