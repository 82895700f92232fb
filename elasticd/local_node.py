"""`elasticd run` on the daemon's node and scheduler cores (prototype on this branch).

One process: a NodeDaemon with its embedded scheduler on a private state dir, serving this run's devices
only, and a client that submits the job, relays the agents' output and says what the job does.
"""

from __future__ import annotations

import json
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
from elasticd.core.lifecycle import JOB_ENDED
from elasticd.daemon import job_user
from elasticd.daemon.server import DaemonConfig, NodeDaemon
from elasticd.statedir import StateDir

POLL_S = 0.05


class LocalNode:
    def __init__(self, devices: int, device_type: str) -> None:
        self.root = Path(tempfile.mkdtemp(prefix=f"elasticd-node-{os.getpid()}-"))
        self.sd = StateDir(self.root)
        cfg = DaemonConfig(state_dir=self.sd, cpu_devices=devices if device_type == "cpu" else None,
                           heartbeat_s=0.1, relayout=False, jobs_as=job_user.own().name)
        self.daemon = NodeDaemon(cfg)
        self.thread = threading.Thread(target=self.daemon.run, name="elasticd-node", daemon=True)
        self.thread.start()
        self.client = Client(Target(transport.ipc_endpoint(self.sd.daemon_sock)), timeout_s=30.0)
        self._offsets: dict[Path, int] = {}

    def close(self) -> None:
        self.client.close()
        self.daemon.stop()
        self.thread.join(30)
        shutil.rmtree(self.root, ignore_errors=True)

    def relay(self, job_id: str) -> None:
        """The agents' new output, to this process's stdout (header lines of the daemon's logs left out)."""
        folder = self.sd.log_dir(job_id)
        if not folder.is_dir():
            return
        for path in sorted(folder.glob("rank*.log")):
            start = self._offsets.get(path, 0)
            with open(path, "rb") as f:
                f.seek(start)
                chunk = f.read()
            end = chunk.rfind(b"\n") + 1
            if end <= 0:
                continue
            self._offsets[path] = start + end
            for line in chunk[:end].splitlines(keepends=True):
                if not line.startswith(b"=== elasticd: job "):
                    sys.stdout.buffer.write(line)
            sys.stdout.flush()


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
            node.relay(job_id)
            rs = info.resizing
            if rs is not None and rs.phase == "go" and rs.epoch != told:
                told = rs.epoch
                _say(f"resize {rs.src} -> {rs.dst} devices: agents told to hand over at their next step boundary")
            for r in info.resizes[said_resizes:]:
                if r.outcome == "pending":
                    break
                said_resizes += 1
                if r.outcome == "done":
                    _say(f"resized {r.src} -> {r.dst} devices after step {r.step} in {r.seconds or 0:.2f}s "
                         f"(training paused {r.stall or 0:.2f}s)")
                elif r.outcome == "refused":
                    _say(f"resize {r.src} -> {r.dst} devices after step {r.step} refused, the job goes on on "
                         f"{r.src} device(s): {r.note}")
                else:
                    _say(f"resize {r.src} -> {r.dst} devices after step {r.step} {r.outcome}: {r.note}")
            for rec in info.recoveries[said_recoveries:]:
                said_recoveries += 1
                _say(f"recovered: {rec.to_dict()}")
            now = time.monotonic()
            if info.state == "running" and now - last_print >= 2.0:
                last_print = now
                shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                 for k, v in info.metrics.items())
                _say(f"step {info.step} on {info.devices} device(s) {shown}".rstrip())
            if info.state in JOB_ENDED:
                break
            time.sleep(POLL_S)
        node.relay(job_id)
        for a in sorted(info.agents, key=lambda a: a.rank):
            t = a.timing
            if t.get("hosted"):
                _say(f"agent {a.rank}: {t['hosted']} worker(s), compute {t['compute_s']:.4f}s/step, "
                     f"collectives {t['flush_s']:.4f}s/step, over {t['steps']} step(s)")
        code = 0 if info.state == "finished" else 1
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
