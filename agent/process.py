"""One agent process: load the script, join the physical group, time-slice the hosted workers."""

from __future__ import annotations

import dataclasses
import gc
import io
import json
import logging
import os
import socket
import sys
import time
import traceback
from typing import Any, TypeVar

import torch

from elasticd import protocol as p
from elasticd.agent import proc_name
from elasticd.agent.comm import beat, islands
from elasticd.agent.comm.islands import emulated_islands, emulated_link
from elasticd.agent.comm.physical import PeerLost, PhysicalGroup
from elasticd.agent.compat.torch_dist import install as install_torch_dist
from elasticd.agent.control.channel import ControlChannel, NullControl
from elasticd.agent.cpu_pin import allowed_cores, pin
from elasticd.agent.private.registry import attach as attach_private
from elasticd.agent.resize import fallback
from elasticd.agent.resize.moves import grow, relayout, shrink
from elasticd.agent.resize.periodic import PeriodicSnapshots, latest_complete
from elasticd.agent.resize.snapshot import AgentSnapshot
from elasticd.agent.runtime import Runtime, WorkerFailed
from elasticd.agent.script import load_target
from elasticd.agent.script_main import script_args
from elasticd.agent.slicer import rng
from elasticd.agent.slicer.boundary import RunOutcome
from elasticd.agent.slicer.device import set_deterministic
from elasticd.core.agent_config import DEVICE_AT_JOIN, AgentConfig, cuda_ordinal, joined, shares_devices
from elasticd.core.cadence import Every
from elasticd.core.failures import Cause
from elasticd.core.layout import Layout
from elasticd.core.parts import periodic_dir
from elasticd.protocol.agents import AgentCommand, AgentJoin, AgentResize, AgentStop

log = logging.getLogger(__name__)


def _control(cfg: AgentConfig) -> ControlChannel:
    if cfg.control:
        from elasticd.agent.control.zmq_channel import ZmqControl

        return ZmqControl(cfg.control, cfg.job_id, cfg.rank)
    return NullControl(cfg.rank)


def _device(cfg: AgentConfig) -> torch.device:
    """The agent's device. A CUDA standby started without a GPU (DEVICE_AT_JOIN) gets a placeholder until
    its join names its rank: nothing touches CUDA before that (warm-up is CPU only)."""
    if cfg.device_type == "cuda":
        if cfg.standby and cfg.device_index == DEVICE_AT_JOIN:
            return torch.device("cuda")
        index = cuda_ordinal(cfg.device_index, cfg.rank, torch.cuda.device_count(), shares_devices())
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)  # this thread's; worker threads set their own (agent/runtime.py)
        return device
    return torch.device("cpu")


def _report(cfg: AgentConfig, control: ControlChannel, logical_rank: int | None, message: str, tb: str,
            cause: Cause = Cause.USER) -> None:
    """`cause`: Cause.USER (the script raised, or cannot load: retrying cannot help) or Cause.PEER_LOST
    (another agent died: the job can be recovered from its snapshot)."""
    # Bounded as every peer-supplied string is: a report must fit in one frame to reach the launcher.
    error = p.AgentError(message=message[:p.MAX_TEXT_CHARS], traceback=tb[:p.MAX_TEXT_CHARS], cause=cause.value,
                         logical_rank=logical_rank, host=socket.gethostname())
    who = f"logical rank {logical_rank}" if logical_rank is not None else "agent"
    if cause is Cause.PEER_LOST:
        # A survivor of another agent's death: its own traceback says nothing about that death, and "failed"
        # read as a second failure in the launcher's output just before it recovered the job.
        during = f" in logical rank {logical_rank}'s collective" if logical_rank is not None else ""
        print(f"[elasticd] agent {cfg.rank} of {cfg.world} on {error.host} lost a peer agent{during}: {message}",
              file=sys.stderr, flush=True)
    else:
        print(f"[elasticd] {who} (agent {cfg.rank} of {cfg.world} on {error.host}) failed: {message}\n{tb}",
              file=sys.stderr, flush=True)
    if cfg.error_file:
        with open(cfg.error_file, "w") as f:
            json.dump(error.as_dict(cfg.job_id, cfg.rank), f)
    try:
        control.failed(error)
    except Exception:  # noqa: BLE001 - reporting must not mask the original failure
        log.exception("could not report the failure to the control channel")


def _set_threads(cfg: AgentConfig, device: torch.device, deterministic: bool) -> None:
    if device.type == "cpu":
        # Agents of one job share the node's cores; deterministic mode pins one thread so that CPU
        # kernels reduce in the same order whatever the number of agents.
        share = max(1, (os.cpu_count() or 1) // cfg.world)
        if cfg.cpu_slots >= 0 and os.environ.get("ELASTICD_CPU_PIN", "1") != "0":
            # Slot and slot count follow the rank on a one-node launcher, so a resize re-cuts the blocks.
            slot, slots = (cfg.rank, cfg.world) if cfg.cpu_slots == 0 else (cfg.device_index, cfg.cpu_slots)
            if pin(slot, slots):
                share = max(1, len(allowed_cores()) // slots)   # the block's size
        torch.set_num_threads(cfg.threads or (1 if deterministic else share))


def warm_up() -> None:
    """Pay torch's lazy first-use costs (building the first optimizer imports its compiler stack,
    seconds on a busy machine) before the agent reports ready, not inside a resize."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)


C = TypeVar("C", bound=AgentCommand)


def _wait_for(control: ControlChannel, kind: type[C], timeout_s: float | None) -> C | None:
    """The next command of type `kind` (None if told to stop, or if the launcher went away); other
    commands meanwhile are not for this moment of the agent's life and are dropped."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    parent = os.getppid()
    while deadline is None or time.monotonic() < deadline:
        for cmd in control.poll():
            if isinstance(cmd, kind):
                return cmd
            if isinstance(cmd, AgentStop):
                return None
        if os.getppid() != parent:
            return None
        time.sleep(0.01)  # a control channel has no blocking read in its interface; poll gently
    raise TimeoutError(f"no {kind.op} command reached this agent in {timeout_s:.0f}s")


class AgentProcess:
    """One agent's life: load the script, then (join,) run, (resize, run)* until done, failed or left.

    An agent that leaves in a shrink may stay warm as a standby (the command says so when a grow is
    coming), so the grow finds a process ready to take ranks instead of starting one.
    """

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.device = _device(cfg)
        self.control = _control(cfg)
        self.phys: PhysicalGroup | None = None
        self.ef: Any = None
        self._stopped_at: int | None = None  # the step boundary of the latest resize
        self.periodic: PeriodicSnapshots | None = None
        self._resumed: int | None = None     # the periodic snapshot's step this agent restored
        self._stall_from: float | None = None   # its last step before the resize it is re-forming for

    def main(self) -> int:
        try:
            try:
                # Before the script runs its imports: `from torch.nn.parallel import DistributedDataParallel`
                # must bind the worker-aware class (agent/compat/torch_dist.py), in the script and in its helpers.
                install_torch_dist()
                beat.start(self.cfg.error_file)   # for the supervisor's watchdog (elasticd/core/watchdog.py)
                proc_name.set_name(self.cfg.rank, self.cfg.standby)
                # What is loaded so far (torch, elasticd: some 300,000 objects) lives as long as the process:
                # the collections of each resize and the exit's look for open files skip it, as they do in
                # an agent forked from a fork server (agent/forkserver.py). The script's objects come after.
                gc.freeze()
                rng.mark_start()  # the process's random streams before the script can seed them
                self.ef = load_target(self.cfg.script, self.cfg.func, script_args())
            except BaseException as e:  # noqa: BLE001 - a broken script is the user's error, reported whole
                _report(self.cfg, self.control, None, f"cannot load {self.cfg.script}: {type(e).__name__}: {e}",
                        traceback.format_exc())
                return 1
            try:   # read again by each group the agents form; refused here, once
                emulated_islands(self.cfg.world)
                emulated_link()
            except ValueError as e:
                _report(self.cfg, self.control, None, str(e), "")
                return 1
            _set_threads(self.cfg, self.device, self.ef.deterministic)
            set_deterministic(self.device, self.ef.deterministic)  # CUDA: before any worker's first kernel
            warm_up()
            # Hello means ready: a joining agent is told to go only once it can start computing at once.
            cfg = self.cfg
            self.control.hello(p.AgentInfo(world=cfg.world, hosted=list(cfg.hosted), pid=os.getpid(),
                                           host=socket.gethostname(), device=str(self.device)))
            snap: AgentSnapshot | None = None
            if not (cfg.standby or cfg.join_from):
                self._start()
                if cfg.restore_epoch:
                    try:
                        snap = self._restore()
                    except (fallback.SnapshotMissing, OSError) as e:
                        _report(cfg, self.control, None, f"cannot restore the snapshot of resize "
                                f"{cfg.restore_epoch}: {e}", traceback.format_exc())
                        return 1
                elif cfg.restore_latest:
                    try:
                        snap = self._restore_latest()
                    except (fallback.SnapshotMissing, OSError) as e:
                        _report(cfg, self.control, None, f"cannot restore the periodic snapshot: {e}",
                                traceback.format_exc())
                        return 1
            while True:
                if self.cfg.standby:
                    if not self._await_join():
                        return 0
                if self.cfg.join_from:
                    snap = self._join()
                code, snap = self._run(snap)
                if code is not None:
                    return code
        except PeerLost as e:   # outside the workers: restoring, or re-forming the group in a resize
            _report(self.cfg, self.control, None, str(e), traceback.format_exc(), Cause.PEER_LOST)
            return e.exit_code
        finally:
            if self.periodic is not None:
                self.periodic.close(timeout_s=10.0)
            if self.phys is not None:
                self.phys.close()
            self.control.close()

    def _start(self) -> None:
        cfg = self.cfg
        self.phys = PhysicalGroup.connect(cfg.rank, cfg.world, self.device, cfg.master_addr, cfg.master_port)

    def _restore(self) -> AgentSnapshot:
        cfg = self.cfg
        assert self.phys is not None
        started = time.monotonic()
        snap = fallback.restore(self.phys, cfg.snapshot_dir, cfg.restore_epoch, cfg.layout)
        log.info("restored the snapshot of resize %d in %.2fs", cfg.restore_epoch, time.monotonic() - started)
        return snap

    def _restore_latest(self) -> AgentSnapshot | None:
        """After a failure: the newest periodic snapshot every part of which is on some node of the group."""
        cfg = self.cfg
        assert self.phys is not None
        started = time.monotonic()
        step, skipped = latest_complete(self.phys, cfg.snapshot_dir, cfg.workers)
        if skipped:
            print(f"[elasticd] agent {cfg.rank}: {skipped}; resuming from "
                  f"{'step ' + str(step) if step is not None else 'the beginning'}", file=sys.stderr, flush=True)
        if step is None:
            self._resumed = 0
            return None
        snap = fallback.restore_dir(self.phys, periodic_dir(cfg.snapshot_dir, step), cfg.layout, f"step {step}")
        self._resumed = step
        log.info("restored the periodic snapshot of step %d in %.2fs", step, time.monotonic() - started)
        return snap

    def _periodic(self) -> PeriodicSnapshots | None:
        """This agent's periodic snapshots (kept across resizes: the writer outlives each runtime)."""
        cfg = self.cfg
        assert self.phys is not None
        if self.periodic is None:
            every = Every.parse(cfg.snapshot_every)
            if every.off or not cfg.snapshot_dir:
                return None
            self.periodic = PeriodicSnapshots(cfg.snapshot_dir, every, writes_groups=False,
                                              complete=self._resumed or None)
        self.periodic.writes_groups = self.phys.rank == 0
        self.periodic.phys = self.phys
        return self.periodic

    def _await_join(self) -> bool:
        if torch.cuda.is_initialized():
            # Left in a shrink: the GPU is the job's no more. Give back the blocks the old segment cached (its
            # runtime is unreferenced by now, but the caching allocator keeps what it freed).
            gc.collect()
            torch.cuda.empty_cache()
        join = _wait_for(self.control, AgentJoin, None)
        if join is None:
            return False
        self.cfg = joined(self.cfg, join.rank, join.world, join.join_from, join.master_addr, join.master_port,
                          join.device_index)
        islands.adopt(join.islands, join.world)
        self.device = _device(self.cfg)
        self.control.renumber(join.rank)   # its messages speak as the rank it joins as
        proc_name.set_name(join.rank, False)
        _set_threads(self.cfg, self.device, self.ef.deterministic)
        return True

    def _join(self) -> AgentSnapshot:
        cfg = self.cfg
        started = time.monotonic()
        # The layout comes from agent 0: the old agents have the resize command that names it.
        self.phys, snap, layout = grow(None, None, None, cfg.rank, None, self.device, cfg.master_addr,
                                       cfg.master_port, world=cfg.world)
        self.control.resized(p.ResizedInfo(epoch=None, world=cfg.world, rank=cfg.rank, left=False,
                                           seconds=time.monotonic() - started, blocks=str(layout)))
        self.cfg = dataclasses.replace(cfg, join_from=0, blocks=tuple(layout.wire()))
        return snap

    def _run(self, snap: AgentSnapshot | None) -> tuple[int | None, AgentSnapshot | None]:
        """Run until the job ends (exit code) or this agent is re-laid out (None, its new snapshot)."""
        cfg, ef, control = self.cfg, self.ef, self.control
        assert self.phys is not None
        runtime = Runtime(ef.fn, cfg.workers, cfg.hosted, self.phys, self.device, ef.deterministic, control, snap,
                          layout=cfg.layout)
        runtime.boundary.hold_at = frozenset(cfg.hold_at)
        runtime.boundary.periodic = self._periodic()
        runtime.boundary.resumed_from = self._resumed
        runtime.boundary.stall_from, self._stall_from = self._stall_from, None
        attach_private(runtime, cfg.device_memory or None)  # the --device-memory budget for ctx.private
        try:
            runtime.run()
        except WorkerFailed as f:
            _report(cfg, control, f.rank, f.message, f.traceback, Cause.PEER_LOST if f.peer_lost else Cause.USER)
            return PeerLost.exit_code if f.peer_lost else f.exit_code, None
        if runtime.outcome is not RunOutcome.RESIZE:
            control.done(stopped=runtime.outcome is RunOutcome.STOP)
            return 0, None
        started = time.monotonic()
        # Another agent may have voted for the resize; this one waits for its own copy of it.
        command = runtime.command or _wait_for(control, AgentResize, 300.0)
        if command is None:  # stopped while waiting for the new layout
            control.done(stopped=True)
            return 0, None
        snap = runtime.snapshot()
        self._stopped_at = runtime.boundary.stopped_at
        self._stall_from = runtime.boundary.last_step_at
        if self.periodic is not None:
            self.periodic.close()   # its copies to other nodes use the group that is about to re-form
        del runtime  # the old workers' objects: their state now lives in `snap`, in host memory
        # Workers, contexts and the runtime reference each other: without a collection their model,
        # optimizer and private tensors would hold device memory while the next segment allocates its own.
        gc.collect()
        epoch = command.epoch
        if cfg.snapshot_dir and epoch is not None and epoch > 0:
            # Before any state moves: if the re-forming fails, this is what the job falls back to.
            assert self.phys is not None
            saving = time.monotonic()
            try:
                size = fallback.save(cfg.snapshot_dir, epoch, snap, with_groups=self.phys.rank == 0)
                log.info("resize %d: snapshot saved (%.1f MiB in %.2fs)", epoch, size / 2**20,
                         time.monotonic() - saving)
            except OSError as e:   # e.g. tmpfs full: the resize itself can still succeed
                print(f"[elasticd] agent {cfg.rank}: could not save the snapshot of resize {epoch} ({e}); "
                      "if this resize fails half-way the job cannot fall back", file=sys.stderr, flush=True)
        return self._relayout(command, snap, started)

    def _relayout(self, command: AgentResize, snap: AgentSnapshot, started: float
                  ) -> tuple[int | None, AgentSnapshot | None]:
        cfg, phys = self.cfg, self.phys
        assert phys is not None
        new_world = command.world
        addr, port = command.master_addr, command.master_port
        old = cfg.layout
        new = Layout.of(cfg.workers, new_world, command.blocks)  # checked when the command came (runtime)
        islands.adopt(command.islands, new_world)                 # likewise
        if new_world < phys.world:
            self.phys, snap = shrink(phys, snap, old, new, addr, port, command.keep or None)
        elif new_world > phys.world:
            self.phys, snap, _ = grow(phys, snap, old, phys.rank, new, self.device, addr, port)
        elif new != old:
            # Same agents, other block sizes: the group stays; only the moved ranks' snapshots travel.
            snap = relayout(phys, snap, old, new)
        left = self.phys is None
        # A drain's shrink may renumber the agents that stay: told under the old rank (the launcher knows
        # this connection by it), then the channel speaks as the new one.
        rank = cfg.rank if self.phys is None else self.phys.rank
        self.control.resized(p.ResizedInfo(epoch=command.epoch, world=new_world, rank=rank, left=left,
                                           seconds=time.monotonic() - started, blocks=str(new),
                                           step=self._stopped_at))
        self.control.renumber(rank)
        proc_name.set_name(rank, left)
        if left:
            if command.standby:
                self.cfg = dataclasses.replace(cfg, standby=True)
                return None, None
            # Nothing of the user's runs any more; an interpreter and torch shutdown would hold the
            # device for seconds that a waiting job could use.
            self.control.close()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        self.cfg = dataclasses.replace(cfg, rank=rank, world=new_world, master_addr=addr, master_port=port,
                                       blocks=tuple(new.wire()))
        _set_threads(self.cfg, self.device, self.ef.deterministic)
        return None, snap


def _whole_lines() -> None:
    """The agents of a job share one stdout and stderr (the `elasticd run` terminal, a node's job log).
    Unbuffered (PYTHONUNBUFFERED, which the daemon sets), a print is two writes, its text and then its
    newline, and another agent's line lands between them. Line buffering makes each line one write (atomic
    on a pipe up to PIPE_BUF) and still shows it at once; an explicit flush (progress bars) still works."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(line_buffering=True, write_through=False)


def run_agent(cfg: AgentConfig) -> int:
    _whole_lines()
    logging.basicConfig(level=os.environ.get("ELASTICD_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s %(levelname)s agent{cfg.rank} %(name)s: %(message)s")
    return AgentProcess(cfg).main()
