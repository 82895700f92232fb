"""Everything an agent process needs to know to start, parsed from its command line."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from elasticd.agent.comm.layout import hosted_ranks


@dataclass(slots=True)
class AgentConfig:
    script: str                 # path of the user's script
    func: str | None            # name of the @elastic function; None = the only one in the script
    workers: int                # N logical workers
    rank: int                   # physical rank p of M
    world: int                  # M physical agents
    device_type: str = "cpu"    # "cpu" or "cuda"
    device_index: int = 0       # CUDA ordinal on this node (ignored on CPU)
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    job_id: str = "local"
    control: str | None = None  # ZeroMQ endpoint of the node daemon; None = NullControl
    error_file: str | None = None  # where a failing agent writes its error as JSON
    threads: int = 0            # torch intra-op threads; 0 = share the machine's cores between agents
    join_from: int = 0          # > 0: a new agent joining a resize from a job of `join_from` agents
    standby: bool = False       # start warm, then wait for a "join" command naming rank/world/rendezvous
    device_memory: int = 0      # private-state budget per device in bytes; 0 = default (agent.private)
    snapshot_dir: str = ""      # where resize snapshots are kept for falling back (agent.fallback); "" = not kept
    restore_epoch: int = 0      # > 0: start from the snapshot of that resize (a resize that failed half-way)
    # Steps after which the launcher resizes (`elasticd run --scale-at`): the agents stop there and wait for
    # the command, so the resize happens at that step and not at whichever boundary the command reaches.
    hold_at: tuple[int, ...] = ()

    @property
    def hosted(self) -> list[int]:
        return hosted_ranks(self.workers, self.world, self.rank)

    def to_argv(self) -> list[str]:
        """The command line that `python -m agent` parses back into this config."""
        argv = [
            "--script", self.script, "--workers", str(self.workers), "--rank", str(self.rank),
            "--world", str(self.world), "--device-type", self.device_type,
            "--device-index", str(self.device_index), "--master-addr", self.master_addr,
            "--master-port", str(self.master_port), "--job-id", self.job_id, "--threads", str(self.threads),
        ]
        if self.func:
            argv += ["--func", self.func]
        if self.control:
            argv += ["--control", self.control]
        if self.error_file:
            argv += ["--error-file", self.error_file]
        if self.join_from:
            argv += ["--join-from", str(self.join_from)]
        if self.standby:
            argv += ["--standby"]
        if self.device_memory:
            argv += ["--device-memory", str(self.device_memory)]
        if self.snapshot_dir:
            argv += ["--snapshot-dir", self.snapshot_dir]
        if self.restore_epoch:
            argv += ["--restore-epoch", str(self.restore_epoch)]
        if self.hold_at:
            argv += ["--hold-at", ",".join(map(str, self.hold_at))]
        return argv


def parse_args(argv: list[str] | None = None) -> AgentConfig:
    p = argparse.ArgumentParser(prog="python -m agent", description="elasticd agent: one per (job, device)")
    p.add_argument("--script", required=True)
    p.add_argument("--func", default=None)
    p.add_argument("--workers", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--device-type", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--device-index", type=int, default=0)
    p.add_argument("--master-addr", default="127.0.0.1")
    p.add_argument("--master-port", type=int, default=29500)
    p.add_argument("--job-id", default="local")
    p.add_argument("--control", default=None)
    p.add_argument("--error-file", default=None)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--standby", action="store_true",
                   help="load the script and warm up, then wait for a join command (fast grows)")
    p.add_argument("--join-from", type=int, default=0,
                   help="join a running job that is growing from this many agents (resize)")
    p.add_argument("--device-memory", type=int, default=0, metavar="BYTES",
                   help="budget for replicated plus worker-private state on this device; private state "
                        "beyond it is swapped to host memory between turns (0 = default policy)")
    p.add_argument("--snapshot-dir", default="",
                   help="keep each resize's snapshot here (host memory: tmpfs) until a step completed after it")
    p.add_argument("--restore-epoch", type=int, default=0,
                   help="start from the snapshot of this resize in --snapshot-dir (falling back after a "
                        "resize that failed half-way)")
    p.add_argument("--hold-at", default="", metavar="STEP[,STEP...]",
                   help="stop after these steps for a resize the launcher scheduled, and wait for its command")
    a = p.parse_args(argv)
    cfg = AgentConfig(
        script=a.script, func=a.func, workers=a.workers, rank=a.rank, world=a.world,
        device_type=a.device_type, device_index=a.device_index, master_addr=a.master_addr,
        master_port=a.master_port, job_id=a.job_id, control=a.control, error_file=a.error_file,
        threads=a.threads, join_from=a.join_from, device_memory=a.device_memory, standby=a.standby,
        snapshot_dir=a.snapshot_dir, restore_epoch=a.restore_epoch,
        hold_at=tuple(int(s) for s in a.hold_at.split(",") if s),
    )
    if cfg.restore_epoch and not cfg.snapshot_dir:
        p.error("--restore-epoch needs --snapshot-dir")
    try:
        cfg.hosted  # noqa: B018 - computing the layout validates it
    except ValueError as e:
        p.error(str(e))
    return cfg
