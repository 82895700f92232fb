"""One agent process: load the script, join the physical group, time-slice the hosted workers."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import traceback
from typing import Any

import torch

from agent.config import AgentConfig
from agent.control import ControlChannel, NullControl
from agent.physical import PhysicalGroup
from agent.runtime import Runtime, WorkerFailed
from agent.script import load_function

log = logging.getLogger(__name__)


def _control(cfg: AgentConfig) -> ControlChannel:
    if cfg.control:
        from agent.control_zmq import ZmqControl

        return ZmqControl(cfg.control, cfg.job_id, cfg.rank)
    return NullControl(cfg.rank)


def _device(cfg: AgentConfig) -> torch.device:
    if cfg.device_type == "cuda":
        device = torch.device("cuda", cfg.device_index)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _report(cfg: AgentConfig, control: ControlChannel, logical_rank: int | None, message: str, tb: str) -> None:
    error: dict[str, Any] = {"rank": cfg.rank, "logical_rank": logical_rank, "host": socket.gethostname(),
                             "job": cfg.job_id, "message": message, "traceback": tb}
    who = f"logical rank {logical_rank}" if logical_rank is not None else "agent"
    print(f"[elasticd] {who} (agent {cfg.rank} of {cfg.world} on {error['host']}) failed: {message}\n{tb}",
          file=sys.stderr, flush=True)
    if cfg.error_file:
        with open(cfg.error_file, "w") as f:
            json.dump(error, f)
    try:
        control.failed(error)
    except Exception:  # noqa: BLE001 - reporting must not mask the original failure
        log.exception("could not report the failure to the control channel")


def run_agent(cfg: AgentConfig) -> int:
    logging.basicConfig(level=os.environ.get("ELASTICD_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s %(levelname)s agent{cfg.rank} %(name)s: %(message)s")
    device = _device(cfg)
    control = _control(cfg)
    control.hello({"job": cfg.job_id, "rank": cfg.rank, "world": cfg.world, "hosted": cfg.hosted,
                   "pid": os.getpid(), "host": socket.gethostname(), "device": str(device)})
    phys: PhysicalGroup | None = None
    try:
        try:
            ef = load_function(cfg.script, cfg.func)
        except BaseException as e:  # noqa: BLE001 - a broken script is the user's error, reported whole
            _report(cfg, control, None, f"cannot load {cfg.script}: {type(e).__name__}: {e}",
                    traceback.format_exc())
            return 1
        if device.type == "cpu":
            # Agents of one job share the node's cores; deterministic mode pins one thread so that CPU
            # kernels reduce in the same order whatever the number of agents.
            threads = cfg.threads or (1 if ef.deterministic else max(1, (os.cpu_count() or 1) // cfg.world))
            torch.set_num_threads(threads)
        phys = PhysicalGroup.connect(cfg.rank, cfg.world, device, cfg.master_addr, cfg.master_port)
        runtime = Runtime(ef.fn, cfg.workers, cfg.hosted, phys, device, ef.deterministic, control)
        try:
            runtime.run()
        except WorkerFailed as f:
            _report(cfg, control, f.rank, f.message, f.traceback)
            return 1
        control.done({"job": cfg.job_id, "rank": cfg.rank})
        return 0
    finally:
        if phys is not None:
            phys.close()
        control.close()
