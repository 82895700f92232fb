"""One agent process: load the script, join the physical group, time-slice the hosted workers."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import sys
import time
import traceback
from typing import Any

import torch

from agent.config import AgentConfig
from agent.control import ControlChannel, NullControl
from agent.physical import PhysicalGroup
from agent.private import attach as attach_private
from agent.resize import grow, shrink
from agent.runtime import Runtime, WorkerFailed
from agent.script import load_function
from agent.snapshot import AgentSnapshot
from agent.torch_dist import install as install_torch_dist

log = logging.getLogger(__name__)


def _control(cfg: AgentConfig) -> ControlChannel:
    if cfg.control and cfg.control.startswith("pipe:"):
        from agent.control_pipe import PipeControl

        return PipeControl.from_spec(cfg.control, cfg.rank)
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


def _set_threads(cfg: AgentConfig, device: torch.device, deterministic: bool) -> None:
    if device.type == "cpu":
        # Agents of one job share the node's cores; deterministic mode pins one thread so that CPU
        # kernels reduce in the same order whatever the number of agents.
        threads = cfg.threads or (1 if deterministic else max(1, (os.cpu_count() or 1) // cfg.world))
        torch.set_num_threads(threads)


def _warm_up() -> None:
    """Pay torch's lazy first-use costs (building the first optimizer imports its compiler stack,
    seconds on a busy machine) before the agent reports ready, not inside a resize."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


def _wait_for_resize(control: ControlChannel, timeout_s: float = 300.0) -> dict | None:
    """Another agent voted for the resize; this one waits for its own copy of the command."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for cmd in control.poll():
            if cmd.get("op") == "resize":
                return cmd
            if cmd.get("op") == "stop":
                return None
        time.sleep(0.01)  # a control channel has no blocking read in its interface; poll gently
    raise TimeoutError(f"agents agreed to resize but no resize command reached this agent in {timeout_s:.0f}s")


def run_agent(cfg: AgentConfig) -> int:
    logging.basicConfig(level=os.environ.get("ELASTICD_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s %(levelname)s agent{cfg.rank} %(name)s: %(message)s")
    device = _device(cfg)
    control = _control(cfg)
    phys: PhysicalGroup | None = None
    try:
        try:
            # Before the script runs its imports: `from torch.nn.parallel import DistributedDataParallel`
            # must bind the worker-aware class (agent/torch_dist.py), in the script and in its helpers.
            install_torch_dist()
            ef = load_function(cfg.script, cfg.func)
        except BaseException as e:  # noqa: BLE001 - a broken script is the user's error, reported whole
            _report(cfg, control, None, f"cannot load {cfg.script}: {type(e).__name__}: {e}",
                    traceback.format_exc())
            return 1
        _set_threads(cfg, device, ef.deterministic)
        _warm_up()
        # Hello means ready: a joining agent is told to go only once it can start computing at once.
        control.hello({"job": cfg.job_id, "rank": cfg.rank, "world": cfg.world, "hosted": cfg.hosted,
                       "pid": os.getpid(), "host": socket.gethostname(), "device": str(device)})
        snap: AgentSnapshot | None = None
        if cfg.join_from:
            started = time.monotonic()
            phys, snap = grow(None, None, cfg.workers, cfg.join_from, cfg.rank, cfg.world, device,
                              cfg.master_addr, cfg.master_port)
            control.resized({"epoch": None, "world": cfg.world, "rank": cfg.rank, "left": False,
                             "seconds": time.monotonic() - started})
        else:
            phys = PhysicalGroup.connect(cfg.rank, cfg.world, device, cfg.master_addr, cfg.master_port)
        while True:
            runtime = Runtime(ef.fn, cfg.workers, cfg.hosted, phys, device, ef.deterministic, control, snap)
            attach_private(runtime, cfg.device_memory or None)  # the --device-memory budget for ctx.private
            try:
                runtime.run()
            except WorkerFailed as f:
                _report(cfg, control, f.rank, f.message, f.traceback)
                return 1
            if runtime.outcome != "resize":
                control.done({"job": cfg.job_id, "rank": cfg.rank, "stopped": runtime.outcome == "stop"})
                return 0
            started = time.monotonic()
            command = runtime.command or _wait_for_resize(control)
            if command is None:  # stopped while waiting for the new layout
                control.done({"job": cfg.job_id, "rank": cfg.rank, "stopped": True})
                return 0
            snap = runtime.snapshot()
            del runtime  # the old workers' objects: their state now lives in `snap`
            new_world = int(command["world"])
            addr, port = str(command["master_addr"]), int(command["master_port"])
            if new_world < phys.world:
                new_phys, snap = shrink(phys, snap, cfg.workers, new_world, addr, port)
            elif new_world > phys.world:
                new_phys, snap = grow(phys, snap, cfg.workers, phys.world, phys.rank, new_world, device, addr, port)
            else:
                new_phys = phys
            info = {"epoch": command.get("epoch"), "world": new_world, "rank": cfg.rank,
                    "left": new_phys is None, "seconds": time.monotonic() - started}
            control.resized(info)
            if new_phys is None:
                phys = None
                return 0
            phys = new_phys
            cfg = dataclasses.replace(cfg, world=new_world, master_addr=addr, master_port=port, join_from=0)
            _set_threads(cfg, device, ef.deterministic)
    finally:
        if phys is not None:
            phys.close()
        control.close()
