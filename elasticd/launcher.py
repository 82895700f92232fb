"""`elasticd run`: start M agent processes for one job on this machine, no daemon.

Gang semantics: all agents start together; if one fails, its error (logical rank, host, traceback)
is shown and every other agent is stopped, so nothing hangs on a collective that can never finish.
The launcher talks to its agents over pipes (`elasticd.agent.control.pipe_channel`) in the daemon's vocabulary
(the typed messages of `elasticd.protocol.agents`, one JSON line each), which also lets it resize the
job live on a schedule (`--scale-at STEP:M[:B1/B2/...]`, other block sizes at the same M included: a live
re-layout): the same resize path the daemon drives, minus the
scheduler. As under the daemon, the agents save each resize's snapshot to tmpfs before any state moves
(agent/resize/fallback.py), and a resize that fails half-way (an agent dies after the go) is rolled back: every
agent is stopped and the job restarts on its old number of devices from that snapshot.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import psutil

from elasticd import protocol as p
from elasticd.core import parts
from elasticd.core.agent_config import AgentConfig, launch_device_index
from elasticd.core.cadence import DEFAULT_MAX_RESTARTS, DEFAULT_SNAPSHOT_EVERY
from elasticd.core.commands import module_command
from elasticd.core.exits import EXIT_PEER_LOST
from elasticd.core.failures import Cause, how_it_ended, is_infrastructure, no_restart
from elasticd.core.layout import Layout
from elasticd.core.lifecycle import ResizeOutcome, ResizePhase
from elasticd.core.records import Recovery, ResizeEntry
from elasticd.core.timing import STALL_METRIC, clean_timing, merge_timing
from elasticd.core.watchdog import (
    WATCH_EVERY_S,
    Fence,
    StuckAfter,
    Watchdog,
    beat_path,
    is_stopped,
    read_beat,
)
from elasticd.forked import ForkedProcess, ForkServer, shared_server, supported
from elasticd.ports import free_port
from elasticd.protocol.lines import LineReader, encode_line
from elasticd.resize_plan import NO_DEADLINE, Action, Done, Fail, FallBack, Go, Refuse, ResizePlan, RollBack
from elasticd.run_dirs import private_dir, tmpfs_root
from elasticd.torchrun_restart import recoverable, relaunch

log = logging.getLogger(__name__)
HERE = "local"   # the one place of a local job's layout, in the resize plan's terms


@dataclass(eq=False)
class _Agent:
    rank: int
    proc: subprocess.Popen | ForkedProcess
    commands: int          # our end of the command pipe
    events: int            # our end of the event pipe
    error_file: str
    reader: LineReader = field(default_factory=lambda: LineReader(p.EVENTS))
    ready: bool = False     # said hello: script loaded, warmed up


@dataclass
class ResizeRecord:
    """One live resize, as the launcher saw it."""

    step: int               # the last step before the resize (the agents' report once they stopped there)
    src: int
    dst: int
    requested: float
    blocks: list[int] = field(default_factory=list)   # the new layout's block sizes (empty: uniform)
    commanded: float | None = None  # when the running agents were told (after joiners were ready)
    last_old_step: float | None = None
    seconds: float | None = None  # request -> first completed step at the new size
    stall: float | None = None    # last step at the old size -> first step at the new size
    outcome: ResizeOutcome = ResizeOutcome.PENDING
    note: str = ""                # why it was refused
    why: str = "--scale-at"
    at: float = field(default_factory=time.time)   # wall clock, as the job history's entries

    def to_dict(self) -> dict[str, Any]:
        """The job history's entry (elasticd.core.records.ResizeEntry), as the scheduler keeps it."""
        return ResizeEntry(src=self.src, dst=self.dst, outcome=self.outcome.value, at=round(self.at, 3),
                           why=self.why, step=self.step, blocks=list(self.blocks), note=self.note,
                           seconds=None if self.seconds is None else round(self.seconds, 3),
                           stall=None if self.stall is None else round(self.stall, 3)).to_dict()


@dataclass
class LocalRun:
    script: str
    func: str | None
    workers: int
    devices: int
    device_type: str = "cpu"
    threads: int = 0
    env: dict[str, str] | None = None
    # (after step, devices[, blocks]): blocks in any form Layout.of takes (empty: uniform)
    scale_at: list[tuple[int, ...] | tuple[int, int, list[int]]] = field(default_factory=list)
    quiet: bool = False
    device_memory: int = 0  # --device-memory for every agent; 0 = default policy
    snapshot_dir: str = ""  # where resize snapshots are kept for falling back; "" = a private tmpfs directory
    snapshot_every: str = DEFAULT_SNAPSHOT_EVERY   # periodic snapshots to recover from (agent/resize/periodic.py)
    max_restarts: int = DEFAULT_MAX_RESTARTS       # recoveries after an agent died, before the run fails
    torchrun: bool = False  # a script with no @elastic function: resizes and recoveries restart it (torchrun_restart.py)
    blocks: list[int] = field(default_factory=list)  # the starting layout's block sizes (empty: uniform)
    stuck_after: str = "auto"   # when an agent counts as stuck and is fenced (elasticd/core/watchdog.py)
    # The agents' fork server (elasticd/forked.py): agents fork from one process that imported torch once.
    # run() starts it, so that it imports while the launcher sets up, unless the caller started it already
    # (the CLI, to read a computed N); run() closes it either way.
    forks: ForkServer | None = None

    def __post_init__(self) -> None:
        self.world = self.devices
        # Raises ValueError for a layout that is none (the CLI checked it already, with a usage error).
        self.blocks = Layout.of(self.workers, self.devices, self.blocks).wire()
        schedule = []
        for item in self.scale_at:
            step, target = item[0], item[1]
            blocks = list(item[2]) if len(item) > 2 else []  # type: ignore[misc]
            schedule.append((step, target, Layout.of(self.workers, target, blocks).wire()))
        self.scale_at = schedule  # type: ignore[assignment]
        self.timing: dict[int, dict[str, float]] = {}   # physical rank -> its agent's step timing, whole run
        self.epoch = 0
        self.agents: dict[int, _Agent] = {}
        self.retired: list[_Agent] = []
        self.spares: list[_Agent] = []  # warm standby agents for the schedule's grows
        self.resizes: list[ResizeRecord] = []
        self._pending: list[tuple[int, int, list[int]]] = sorted(schedule, key=lambda e: e[0])
        self._plan: ResizePlan | None = None         # the decisions about the resize in flight
        self._resizing: ResizeRecord | None = None         # its record, for the summary
        self._command: p.AgentResize | None = None   # what the running agents are told at its go
        self._left: dict[int, _Agent] = {}           # its leavers, by old rank, until it is done or refused
        self._hold_at = _hold_steps(self.devices, self._pending, self.blocks)
        self._sel = selectors.DefaultSelector()
        self._tmp = private_dir(tempfile.gettempdir())   # the agents' error reports and beat files
        self._own_snapshots = not self.snapshot_dir
        if not self.snapshot_dir:
            self.snapshot_dir = private_dir(tmpfs_root())
        self._restore_epoch = 0   # > 0 while the agents restarted from that resize's snapshot have not stepped
        self.recoveries: list[Recovery] = []   # one per restart after an agent died
        self._recovering: Recovery | None = None   # the recovery whose first step has not come yet
        self._last_print = 0.0
        self.last_step = -1
        self.restarts = 0      # torchrun mode: agent restarts so far (resizes and recoveries)
        self.torchrun_recoveries = 0   # torchrun mode: restarts after an agent died (bounded by max_restarts)
        self._restarting: ResizeRecord | None = None   # torchrun mode: the restart waiting for its first step
        self._watchdog = Watchdog(StuckAfter.parse(self.stuck_after))   # keyed by pid: a new agent starts afresh
        self._fenced: dict[int, Fence] = {}    # pid -> why the watchdog killed it
        self._next_watch = 0.0

    # -- processes ----------------------------------------------------------------------------
    def _spawn(self, rank: int, world: int, port: int, join_from: int = 0, standby: bool = False) -> _Agent:
        cmd_r, cmd_w = os.pipe()
        ev_r, ev_w = os.pipe()
        cfg = AgentConfig(
            # A standby agent's rank and world are placeholders until its join command names them.
            script=os.path.abspath(self.script), func=self.func, workers=self.workers, rank=max(rank, 0), world=world,
            device_type=self.device_type, device_index=launch_device_index(rank, self.device_type), master_port=port, threads=self.threads,
            cpu_slots=0 if self.device_type == "cpu" else -1,  # every agent is on this node: one block each
            device_memory=self.device_memory, blocks=() if (standby or join_from) else tuple(self.blocks),
            error_file=os.path.join(self._tmp,
                                    f"agent{rank}-{self.epoch}-{len(self.spares)}-{len(self.recoveries)}.json"),
            control=f"pipe:{cmd_r},{ev_w}", join_from=join_from, standby=standby,
            snapshot_dir=self.snapshot_dir, restore_epoch=0 if (standby or join_from) else self._restore_epoch,
            hold_at=self._hold_at, snapshot_every=self.snapshot_every,
            restore_latest=bool(self.recoveries) and not (standby or join_from or self._restore_epoch),
        )
        with contextlib.suppress(FileNotFoundError):
            os.unlink(beat_path(cfg.error_file))   # an earlier agent's, under the same name: not this one's beat
        env = self._agent_env()
        proc: subprocess.Popen | ForkedProcess | None = None
        if self.forks is not None:
            proc = self.forks.spawn(cfg.to_argv(), env, (cmd_r, ev_w))
        if proc is None:
            proc = subprocess.Popen([*module_command(), *cfg.to_argv()], env=env, pass_fds=(cmd_r, ev_w))
        os.close(cmd_r)
        os.close(ev_w)
        agent = _Agent(rank, proc, cmd_w, ev_r, cfg.error_file or "")
        if not standby:
            self.agents[rank] = agent
        self._sel.register(ev_r, selectors.EVENT_READ, agent)
        return agent

    def _agent_env(self) -> dict[str, str]:
        return {**os.environ, **(self.env or {})}

    def _top_up_spares(self) -> None:
        """Keep enough warm standby agents for the largest grow still in the schedule, so a grow waits
        for a hand-over, not for processes to start (seconds of imports on a busy machine)."""
        if self.torchrun:
            return   # a torchrun-mode resize restarts every agent: nothing to keep warm
        future = max((m for _, m, _ in self._pending), default=0)
        for _ in range(future - self.world - len(self.spares)):
            self.spares.append(self._spawn(-1, 1, 0, standby=True))

    def _send(self, agent: _Agent, command: p.AgentCommand) -> None:
        try:
            os.write(agent.commands, encode_line(command))
        except BrokenPipeError:
            pass  # the agent died; its exit code tells the story

    def stop_all(self, grace_s: float = 5.0) -> None:
        self._stop([*self.agents.values(), *self.retired, *self.spares], grace_s)

    @staticmethod
    def _stop(agents: list[_Agent], grace_s: float) -> None:
        """SIGTERM, then SIGKILL what is still there after `grace_s`; returns once every one has exited."""
        procs = [a.proc for a in agents]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    # -- events -------------------------------------------------------------------------------
    def _on_event(self, agent: _Agent, ev: p.Message) -> None:
        plan = self._plan
        if isinstance(ev, p.AgentStep) and ev.timing and agent in self.agents.values():
            self._on_timing(agent.rank, ev.timing)
        if isinstance(ev, p.AgentStep) and agent.rank == 0 and agent in self.agents.values():
            self._on_step(ev.step, ev.metrics)
        elif isinstance(ev, p.AgentHello):
            agent.ready = True
            if plan is not None:
                self._execute(plan.joiner_ready(agent.rank, time.monotonic()))
        elif isinstance(ev, p.AgentResized) and plan is not None:
            plan.reformed(agent.rank)
            if self._resizing is not None and ev.info.step is not None:
                self._resizing.step = ev.info.step   # the step the agents stopped after: what the summary records
            self._advance(time.monotonic())
        elif isinstance(ev, p.AgentResizeRefused):
            # Every agent says so; the first while a plan is in flight counts (before it, an agent other than
            # rank 0 may report its refusal of a held step before rank 0's step report made the plan).
            if plan is not None:
                if self._resizing is not None:
                    self._resizing.step = ev.info.step
                self._execute(plan.refused(ev.info.message or "a state could not be captured"))

    def _on_timing(self, rank: int, timing: dict[str, Any]) -> None:
        """Fold an agent's timing report into its whole-run means (per physical rank: a resize that
        renumbers agents starts a rank's record over with its new block)."""
        try:
            report = clean_timing(timing)
        except ValueError as e:
            log.warning("agent %d sent a bad timing report: %s", rank, e)
            return
        seen = self.timing.get(rank)
        if seen is not None and seen["hosted"] != report["hosted"]:
            seen = None
        self.timing[rank] = merge_timing(seen, report)

    def _on_step(self, step: int, metrics: dict[str, Any]) -> None:
        self.last_step = step
        now = time.monotonic()
        if self._restarting is not None:
            self._restarted(now)
        plan, r = self._plan, self._resizing
        if plan is not None and r is not None and not plan.acked:
            r.last_old_step = now
        elif plan is None and self._restore_epoch:
            self._restore_epoch = 0
            self._drop_snapshots()
        if self._recovering is not None:
            self._recovered(step, metrics, now)
        self._advance(now)
        if now - self._last_print >= 2.0:
            self._last_print = now
            shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()
                             if not k.startswith("snapshot_") and k not in ("resumed_from", STALL_METRIC))
            counted = "optimizer step" if self.torchrun else "step"   # torchrun mode: script_main.StepCounter
            self._say(f"{counted} {step} on {self.world} device(s) {shown}".rstrip())

    def _advance(self, now: float) -> None:
        """Close the resize in flight once every new agent re-formed and a step ran after it, then start the
        next scheduled one whose step has passed. Called on steps and on re-formation reports: rank 0's next
        step may be read before another agent's report, and the agents are held at the next scheduled step
        until its command comes, so neither order may stall the schedule."""
        step = self.last_step
        plan, r = self._plan, self._resizing
        if plan is not None and r is not None and step > r.step:
            self._execute(plan.stepped(now))
        if self._plan is None and self._pending and step >= self._pending[0][0]:
            _, target, blocks = self._pending.pop(0)
            if self.torchrun and (target, blocks) != (self.world, self.blocks):
                self.blocks = blocks   # a restart spawns its agents on the layout it asks for
                self._restart(step, target, "--scale-at")
            else:
                self._resize(step, target, blocks)

    def _restart(self, step: int, target: int, why: str) -> None:
        """torchrun mode: stop every agent and start the job again on `target` devices (torchrun_restart.py)."""
        now = time.monotonic()
        r = ResizeRecord(step=step, src=self.world, dst=target, requested=now, commanded=now,
                         outcome=ResizeOutcome.RESTARTING, why=why)
        self.resizes.append(r)
        self._say(f"{why}: restarting the torchrun-mode job on {target} device(s) after optimizer step {step}; the "
                  f"script starts again from its beginning (it continues where it was only if it loads its own "
                  f"checkpoint)")
        relaunch(self, step, target)
        self._restarting = r

    def _restarted(self, now: float) -> None:
        r = self._restarting
        assert r is not None
        r.seconds = r.stall = now - r.requested
        r.outcome = ResizeOutcome.RESTARTED
        self._restarting = None
        self._say(f"restarted on {r.dst} device(s): first step {r.seconds:.2f}s after the request")

    def _resize(self, step: int, target: int, blocks: list[int]) -> None:
        if target == self.world and blocks == self.blocks:
            self._say(f"scale to {target} devices: already there, nothing to do")
            return
        self.epoch += 1
        port = free_port()
        now = time.monotonic()
        old = self.world
        plan = self._plan = ResizePlan.begin(
            epoch=self.epoch, src=old, dst=target, why="--scale-at", now=now, step=step, timeout_s=NO_DEADLINE,
            placement=[[HERE, str(rank)] for rank in range(target)], blocks=blocks, src_blocks=self.blocks)
        self._resizing = ResizeRecord(step=step, src=old, dst=target, requested=now, blocks=blocks)
        self.resizes.append(self._resizing)
        # Agents that leave stay warm for a grow still to come, instead of exiting.
        keep_warm = max((m for _, m, _ in self._pending), default=0) > target
        self._command = p.AgentResize(epoch=self.epoch, world=target, master_addr="127.0.0.1", master_port=port,
                                      standby=keep_warm, blocks=blocks)
        if plan.joiners:
            # The job keeps training until every joining agent is ready; then it stops for the hand-over.
            self.world = target
            for rank in plan.joiners:
                if self.spares:
                    agent = self.spares.pop(0)
                    agent.rank = rank
                    self.agents[rank] = agent
                    self._send(agent, p.AgentJoin(rank=rank, world=target, join_from=old, master_addr="127.0.0.1",
                                                  master_port=port,
                                                  device_index=launch_device_index(rank, self.device_type)))
                else:
                    self._spawn(rank, target, port, join_from=old)
        actions = plan.port_known(port, now)
        for rank in plan.joiners:
            if self.agents[rank].ready:
                actions += plan.joiner_ready(rank, now)
        self._execute(actions)

    def _execute(self, actions: list[Action]) -> None:
        """What the resize plan decided; the failures (Abort, RollBack) are acted on in `run`."""
        for action in actions:
            if isinstance(action, Go):
                self._go()
            elif isinstance(action, Done):
                self._done(action)
            elif isinstance(action, Refuse):
                self._refused(action.reason)

    def _go(self) -> None:
        plan, r, command = self._plan, self._resizing, self._command
        assert plan is not None and r is not None and command is not None
        r.commanded = plan.commanded_at
        for rank in range(plan.src):
            self._send(self.agents[rank], command)
        self.blocks = list(plan.blocks)   # what a recovery restarts on from now on (a fall-back: plan.src_blocks)
        self._say(f"resize {r.src} -> {r.dst} devices{_shown(plan.blocks)}: agents told to hand over at their "
                  f"next step boundary")
        if plan.leavers:
            for rank in plan.leavers:
                agent = self._left[rank] = self.agents.pop(rank)
                (self.spares if command.standby else self.retired).append(agent)
            self.world = plan.dst
            self._top_up_spares()

    def _done(self, done: Done) -> None:
        r = self._resizing
        assert r is not None
        now = time.monotonic()
        r.seconds = done.seconds
        r.stall = now - (r.last_old_step or r.requested)
        r.outcome = ResizeOutcome.DONE
        self._plan, self._resizing, self._command, self._left = None, None, None, {}
        self._drop_snapshots()   # a step ran on the new group: nothing falls back to them any more
        self._say(f"resized {r.src} -> {r.dst} devices{_shown(r.blocks)} after step {r.step} in {r.seconds:.2f}s "
                  f"(training paused {r.stall:.2f}s)")

    def _refused(self, reason: str) -> None:
        """The agents could not carry a worker's state and train on at the old size: the joiners, waiting
        for a group that will not form, are stopped; the leavers are the job's again; the rest of the
        --scale-at schedule is dropped (the agents dropped its held steps at the same boundary)."""
        plan, r = self._plan, self._resizing
        assert plan is not None and r is not None
        for rank in plan.joiners:
            joiner = self.agents.pop(rank, None)
            if joiner is not None:
                self._discard(joiner)
        for rank, agent in self._left.items():
            for pool in (self.spares, self.retired):
                if agent in pool:
                    pool.remove(agent)
            self.agents[rank] = agent
        self.world, self.blocks = plan.src, list(plan.src_blocks)
        r.outcome, r.note = ResizeOutcome.REFUSED, reason
        dropped = [f"{s}:{m}" for s, m, _ in self._pending]
        self._pending, self._hold_at = [], ()
        self._plan, self._resizing, self._command, self._left = None, None, None, {}
        self._say(f"resize {r.src} -> {r.dst} devices after step {r.step} refused, the job goes on on {r.src} device(s)"
                  + (f"; --scale-at {','.join(dropped)} dropped" if dropped else "") + f": {reason}")

    def _discard(self, agent: _Agent) -> None:
        """Stop an agent that is no part of the job and forget it (its exit code is no verdict)."""
        self._stop([agent], 5.0)
        self._close(agent)

    def _close(self, agent: _Agent) -> None:
        """Close an exited agent's pipes."""
        if agent.events in self._sel.get_map():   # else already closed by _read at end of file
            self._sel.unregister(agent.events)
            os.close(agent.events)
        os.close(agent.commands)

    def _drop_snapshots(self) -> None:
        for epoch in parts.epochs(self.snapshot_dir):   # only what the agents wrote: --snapshot-dir is the user's
            shutil.rmtree(parts.epoch_dir(self.snapshot_dir, epoch), ignore_errors=True)

    def _agent_died(self, bad: _Agent) -> bool:
        """An agent exited badly. True: the job goes on (fell back to the last resize's snapshot);
        False: the run fails, every agent stopped."""
        plan = self._plan
        error = {"message": f"agent {bad.rank} exited with code {bad.proc.returncode}"}
        actions = plan.agent_failed(time.monotonic(), error, joiner=bad.rank in plan.joiners) if plan else []
        if not any(isinstance(a, RollBack) for a in actions):
            # No hand-over under way (an Abort included: `elasticd run` has no joiners to drop and go on
            # without, it fails as before the resize began).
            return False
        assert plan is not None
        self._read(0)
        self.stop_all()   # synchronous: once it returns no agent of the job runs on this machine
        plan.note_saved(HERE, parts.parts(self.snapshot_dir, plan.epoch))
        plan.place_gone(HERE)
        for action in plan.settle([HERE], self.workers):
            if isinstance(action, FallBack):
                self._fall_back(bad)
                return True
            if isinstance(action, Fail):
                self._say(str(action.error.get("message", action.reason)))
        return False

    def _fall_back(self, bad: _Agent) -> None:
        """Every agent is stopped: start the job again on the old number of devices from the snapshot."""
        r, plan = self._resizing, self._plan
        assert r is not None and plan is not None
        self.blocks = list(plan.src_blocks)
        self._say(f"agent {bad.rank} exited with code {bad.proc.returncode} during the resize {r.src} -> {r.dst}; "
                  f"restarting on {r.src} devices from the snapshot saved at its step boundary")
        self._forget_agents()
        r.outcome = ResizeOutcome.ROLLED_BACK
        self._plan, self._resizing, self._command = None, None, None
        self.world = r.src
        self._restore_epoch = self.epoch
        port = free_port()
        for rank in range(self.world):
            self._spawn(rank, self.world, port)
        self._top_up_spares()

    def _recover(self, bad: _Agent) -> bool:
        """An agent died outside a resize. True: every agent was stopped and the job restarted from its newest
        complete periodic snapshot; False: the run fails (a worker raised, or no restarts are left)."""
        self._read(0)
        cause = self._infrastructure_cause(bad)
        if cause is None or self._plan is not None:
            return False   # the user's error (never retried), or a resize the plan did not roll back
        if len(self.recoveries) >= self.max_restarts:
            self._say(no_restart(cause, len(self.recoveries), self.max_restarts))
            return False
        failed_at = time.time()
        self.stop_all()   # synchronous: once it returns no agent of the job runs on this machine
        # The last step any agent completed, by its beat file: the reports come throttled, the beats do not.
        beats = [read_beat(beat_path(a.error_file)) for a in self.agents.values()]
        failed_after = max([self.last_step, *(b.step for b in beats if b is not None)])
        held = max((f.held for f in self._fenced.values()), default=0.0)
        self._forget_agents()
        self._recovering = Recovery(cause=cause, at=round(failed_at, 3), failed_after_step=failed_after,
                                    from_devices=self.world, devices=self.world, detected_after=round(held, 3))
        self.recoveries.append(self._recovering)
        self._say(f"{cause}; restarting on {self.world} device(s) from the newest complete snapshot "
                  f"(restart {len(self.recoveries)} of at most {self.max_restarts})")
        port = free_port()
        for rank in range(self.world):
            self._spawn(rank, self.world, port)
        self._top_up_spares()
        return True

    def _watch(self, now: float) -> None:
        """Fence (SIGKILL) the job's agents the watchdog finds stuck: the job then recovers as from a killed
        agent, instead of waiting on them until a collective times out (gloo: 10 minutes)."""
        if now < self._next_watch:
            return
        self._next_watch = now + WATCH_EVERY_S
        live = {a.proc.pid: a for a in self.agents.values() if a.proc.returncode is None and a.proc.pid not in self._fenced}
        self._watchdog.retain(live)
        for pid, agent in live.items():
            try:
                stopped = is_stopped(psutil.Process(pid).status())
            except psutil.Error:
                continue   # exited: the loop sees its code
            self._watchdog.observe(pid, now, stopped, read_beat(beat_path(agent.error_file)))
        for fence in self._watchdog.verdict(now):
            agent = live[fence.key]
            self._fenced[fence.key] = fence
            self._say(f"agent {agent.rank} is stuck ({fence.reason}, --stuck-after {self._watchdog.describe()}); "
                      f"fencing it (SIGKILL)")
            with contextlib.suppress(ProcessLookupError):
                agent.proc.kill()

    def _infrastructure_cause(self, bad: _Agent) -> str | None:
        """Why `bad` died when that is not the user's doing; None when a worker raised (its error report
        says so; the agents that lost their group after it say `peer_lost`, which does not count)."""
        fenced = [(a.rank, self._fenced[a.proc.pid]) for a in self.agents.values() if a.proc.pid in self._fenced]
        if fenced:
            rank, fence = min(fenced, key=lambda f: f[0])
            return fence.cause(rank, self._watchdog.describe())
        for a in [*self.agents.values(), *self.retired]:
            try:
                with open(a.error_file) as f:
                    if not is_infrastructure(json.load(f).get("cause", Cause.USER)):
                        return None
            except (OSError, ValueError):
                continue
        code = bad.proc.returncode
        if code == EXIT_PEER_LOST:
            return f"agent {bad.rank} lost its group (another agent died)"
        if code is not None and code < 0:
            return f"agent {bad.rank} {how_it_ended(code)}"
        return f"agent {bad.rank} {how_it_ended(code)} without an error report"

    def _recovered(self, step: int, metrics: dict[str, Any], now: float) -> None:
        rec = self._recovering
        assert rec is not None
        resumed = int(metrics.get("resumed_from", 0))
        rec.resumed(resumed, float(metrics.get("resumed_at") or time.time()))   # wall clock, as `at`
        self._recovering = None
        self._say(f"recovered: resumed at step {resumed} ({rec.steps_redone} step(s) redone), first step "
                  f"{rec.seconds:.2f}s after the failure was detected{_held(rec)}")

    def _forget_agents(self) -> None:
        """Every agent has exited: close their pipes and start from an empty table."""
        for a in [*self.agents.values(), *self.retired, *self.spares]:
            self._close(a)
        self.agents, self.retired, self.spares = {}, [], []
        self._fenced.clear()

    def _unhonoured(self) -> int:
        """The exit code of a job that finished: 1 if its agents refused a --scale-at resize (a state they
        could not carry), or if it never reached a step boundary while --scale-at asked for resizes (they
        could not happen: refused, not ignored), else 0, saying which resizes the job ended before."""
        plan, r = self._plan, self._resizing
        if plan is not None and r is not None and r.commanded is not None and len(plan.acked) == r.dst:
            r.outcome, self._plan, self._resizing = ResizeOutcome.DONE, None, None   # handed over after the last step
        left = [f"{s}:{m}" for s, m, _ in self._pending] + ([f"{r.step}:{r.dst}"] if self._resizing is not None and
                                                             r is not None else [])
        refused = "; ".join(f"{x.step}:{x.dst}: {x.note}" for x in self.resizes if x.outcome is ResizeOutcome.REFUSED)
        if refused:
            print(f"[elasticd] error: --scale-at refused ({refused}). The job trained on at its size from there; its "
                  "result is what its N workers compute, but the resizes asked for did not happen",
                  file=sys.stderr, flush=True)
            return 1
        if not left:
            return 0
        if self.last_step < 0:
            print(f"[elasticd] error: --scale-at {','.join(left)} refused: the function never reached a step "
                  f"boundary of `ctx.steps`, the only place a job can be resized. Its result is what it computed "
                  f"on {self.world} device(s). To resize it, drive its loop with `for step in ctx.steps(n)`",
                  file=sys.stderr, flush=True)
            return 1
        self._say(f"--scale-at {','.join(left)} not applied: the job ended after step {self.last_step}, "
                  f"before reaching {'them' if len(left) > 1 else 'it'}")
        return 0

    def _say_timing(self) -> None:
        """Where each agent's time went, over the run (what a speed-aware placement learns from)."""
        for rank, t in sorted(self.timing.items()):
            self._say(f"agent {rank}: {t['hosted']} worker(s), compute {t['compute_s']:.4f}s/step "
                      f"({t['compute_s'] / t['hosted']:.4f}s per worker), collectives {t['flush_s']:.4f}s/step, "
                      f"over {t['steps']} step(s)")

    def _say(self, text: str) -> None:
        if not self.quiet:
            print(f"[elasticd] {text}", file=sys.stderr, flush=True)

    def _read(self, timeout: float) -> None:
        for key, _ in self._sel.select(timeout):
            if self._sel.get_map().get(key.fd) is not key:
                # Closed while an earlier event of this batch was handled (a torchrun-mode restart forgets
                # every agent), its number perhaps taken by a new agent's pipe since.
                continue
            agent: _Agent = key.data
            chunk = os.read(agent.events, 65536)
            if not chunk:
                self._sel.unregister(agent.events)
                os.close(agent.events)
                continue
            try:
                events = agent.reader.feed(chunk)
            except p.ProtocolError as e:
                raise p.ProtocolError(e.code, f"agent {agent.rank}: {e.message}") from None
            for ev in events:
                self._on_event(agent, ev)

    # -- main loop ----------------------------------------------------------------------------
    def run(self) -> int:
        """Run to completion: 0, or 1 if an agent failed (its error already printed)."""
        try:
            if self.forks is None and supported():
                env = self._agent_env()
                self.forks = ForkServer(env, shared=shared_server("agent", env))
            port = free_port()
            for rank in range(self.devices):
                self._spawn(rank, self.devices, port)
            self._top_up_spares()
            while True:
                self._read(0.1)
                self._watch(time.monotonic())
                everyone = [*self.agents.values(), *self.retired, *self.spares]
                bad = next((a for a in everyone if a.proc.poll() not in (None, 0)), None)
                cause = recoverable(self, bad) if bad is not None and self.torchrun else None
                if cause is not None:
                    self._restart(self.last_step, self.world, cause)
                    continue
                if bad is not None and (self._agent_died(bad) or (not self.torchrun and self._recover(bad))):
                    continue
                if bad is not None:
                    self._read(0)  # pick up its last words
                    self.stop_all()
                    if not os.path.exists(bad.error_file):
                        self._say(f"agent {bad.rank} exited with code {bad.proc.returncode} and left no error "
                                  f"report (killed? out of memory?)")
                    return 1
                # Done when every agent of the job has exited; spares, and joiners the job finished
                # without, have no one left to join.
                plan = self._plan
                waiting = set(plan.joiners) - set(plan.ready) if plan is not None and plan.phase == ResizePhase.PREPARE else set()
                job = [a for a in [*self.agents.values(), *self.retired] if a.rank not in waiting]
                if all(a.proc.poll() == 0 for a in job):
                    self._read(0)
                    if waiting:
                        self._say("job finished before the grow took effect")
                    self.stop_all()
                    self._say_timing()
                    return self._unhonoured()
        except p.ProtocolError as e:
            # Launcher and agents are one install: a line either side cannot read is a bug, and guessing
            # what it meant could resize or stop the wrong way. End the run instead.
            self.stop_all()
            self._say(f"stopping the job: unreadable message from {e.message}")
            return 1
        except KeyboardInterrupt:
            self.stop_all()
            raise
        finally:
            for a in [*self.agents.values(), *self.retired, *self.spares]:
                try:
                    os.close(a.commands)
                except OSError:
                    pass
            self._sel.close()
            if self.forks is not None:
                self.forks.close()
            shutil.rmtree(self._tmp, ignore_errors=True)
            if self._own_snapshots:
                shutil.rmtree(self.snapshot_dir, ignore_errors=True)
            else:   # the run is over: nothing will resume from them (only what the agents wrote goes)
                for step in parts.periodic_steps(self.snapshot_dir):
                    shutil.rmtree(parts.periodic_dir(self.snapshot_dir, step), ignore_errors=True)


def _held(rec: Recovery) -> str:
    return f"; the stuck agent had held the job {rec.detected_after:.1f}s before it was fenced" if rec.detected_after else ""


def _hold_steps(devices: int, schedule: list[tuple[int, int, list[int]]], blocks: list[int]) -> tuple[int, ...]:
    """The steps of a sorted --scale-at schedule that change the layout (a scale to the layout the job will
    have then is a no-op): the agents stop after each and wait for the resize command."""
    held, now = [], (devices, list(blocks))
    for step, target, sizes in schedule:
        if (target, sizes) != now:
            held.append(step)
            now = (target, sizes)
    return tuple(held)


def _shown(blocks: list[int]) -> str:
    return f" (blocks {'/'.join(map(str, blocks))})" if blocks else ""


def run_local(script: str, func: str | None, workers: int, devices: int, device_type: str = "cpu",
              threads: int = 0, env: dict[str, str] | None = None, device_memory: int = 0,
              scale_at: list[Any] | None = None, summary: str | None = None,
              snapshot_dir: str = "", torchrun: bool = False, snapshot_every: str = DEFAULT_SNAPSHOT_EVERY,
              max_restarts: int = DEFAULT_MAX_RESTARTS, blocks: list[int] | None = None,
              stuck_after: str = "auto", forks: ForkServer | None = None) -> int:
    """Run the job to completion; returns 0, or 1 if a worker failed (its error already printed).

    `scale_at`: (after step, devices[, blocks]) entries; `blocks`: the starting layout (empty: uniform).
    """
    job = LocalRun(script, func, workers, devices, device_type, threads, env, scale_at or [], device_memory=device_memory,
                   snapshot_dir=snapshot_dir, torchrun=torchrun, snapshot_every=snapshot_every,
                   max_restarts=max_restarts, blocks=list(blocks or []), stuck_after=stuck_after, forks=forks)
    code = job.run()
    if summary:
        with open(summary, "w") as f:
            json.dump({"exit": code, "last_step": job.last_step, "devices": job.world, "blocks": job.blocks,
                       "resizes": [r.to_dict() for r in job.resizes],
                       "recoveries": [r.to_dict() for r in job.recoveries],
                       "agents": {str(rank): t for rank, t in sorted(job.timing.items())}}, f, indent=1)
    return code
