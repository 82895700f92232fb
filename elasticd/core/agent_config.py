"""Everything an agent process needs to know to start, parsed from its command line.

Each field is declared once, with its help text; the command line (`to_argv`) and its parser
(`parse_args`) are derived from the fields, so a new option cannot be forgotten on one side.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field
from typing import Any

from elasticd.core.cadence import Every
from elasticd.core.env_names import DEVICE_BACKEND_ENV
from elasticd.core.layout import Layout

# An agent command line that asks only for N as the script declares it (agent/__main__.py): a launcher
# sends it to a fork of its warm server rather than import the script, and torch, itself.
WORKERS_OF = "--workers-of"
# device_index of a CUDA agent started as a standby: its rank, hence its GPU, is known only at its join.
DEVICE_AT_JOIN = -1


def joined(cfg: AgentConfig, rank: int, world: int, join_from: int, master_addr: str, master_port: int,
           device_index: int) -> AgentConfig:
    """A standby's launch record once it joins as physical rank `rank`: the device the join names, never
    the one it had (it may have left a shrink from another rank, whose GPU another agent now holds)."""
    return dataclasses.replace(cfg, rank=rank, world=world, join_from=join_from, master_addr=master_addr,
                               master_port=master_port, standby=False, blocks=(), device_index=device_index)


def cuda_ordinal(device_index: int, rank: int, device_count: int, shared: bool = False) -> int:
    """The GPU an agent uses: its --device-index, or its rank's when that is DEVICE_AT_JOIN.

    Raises:
        ValueError: no GPU, or more agents than GPUs while agents may not share one (NCCL refuses two
            ranks on one GPU; `shared` is the ELASTICD_DEVICE_BACKEND=gloo test switch).
    """
    index = rank if device_index < 0 else device_index
    if index < 0:
        raise ValueError(f"agent rank {rank} has no GPU yet: a standby agent is placed only when it joins")
    problem = cuda_capacity_problem(index + 1, device_count, shared)
    if problem is not None:
        raise ValueError(problem)
    return index % device_count


def shares_devices(environ: Mapping[str, str] | None = None) -> bool:
    """Whether agents may share a GPU (only with the gloo test switch: NCCL refuses two ranks on one GPU)."""
    env = os.environ if environ is None else environ
    return env.get(DEVICE_BACKEND_ENV, "") == "gloo"


def cuda_capacity_problem(devices: int, device_count: int, shared: bool = False) -> str | None:
    """Why `devices` CUDA agents cannot run on a node with `device_count` GPUs, or None if they can."""
    if device_count < 1:
        return "--device-type cuda, but torch sees no CUDA device on this node"
    if devices > device_count and not shared:
        return (f"{devices} CUDA agents need {devices} GPUs, but this node has {device_count}: NCCL refuses "
                f"two ranks on one GPU (run with at most {device_count} devices; more logical workers than "
                f"GPUs is what --workers is for)")
    return None


def _steps(text: str) -> tuple[int, ...]:
    return tuple(int(s) for s in text.split(",") if s)


# How each annotation is parsed from, and written to, the command line.
_TYPES: dict[str, tuple[Any, Any]] = {
    "str": (str, str), "str | None": (str, str), "int": (int, str), "bool": (bool, None),
    "tuple[int, ...]": (_steps, lambda v: ",".join(map(str, v))),
}


def _opt(default: Any = MISSING, help: str = "", choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(slots=True)
class AgentConfig:
    script: str = _opt(help="path of the user's script")
    workers: int = _opt(help="N logical workers")
    rank: int = _opt(help="physical rank p of M")
    world: int = _opt(help="M physical agents")
    # A list is accepted too (written the same on the command line); parsed back as a tuple.
    blocks: tuple[int, ...] = _opt((), "logical workers per agent in agent order, e.g. 6,2 (sum N, each >= 1); "
                                       "empty: the uniform layout")
    func: str | None = _opt(None, "name of the @elastic function (default: the only one in the script)")
    device_type: str = _opt("cpu", "device kind", ("cpu", "cuda"))
    device_index: int = _opt(0, "CUDA ordinal on this node (ignored on CPU); -1: the GPU of the rank a standby "
                                    "agent joins as")
    cpu_slots: int = _opt(-1, "CPU: pin this agent's threads to a block of cores of its own: 0 = block --rank "
                               "of --world (every agent on this node), K > 0 = block --device-index of K; "
                               "-1 = no pinning")
    master_addr: str = _opt("127.0.0.1", "rendezvous address of the physical group")
    master_port: int = _opt(29500, "rendezvous port of the physical group")
    job_id: str = _opt("local", "job id, in logs and reports")
    control: str | None = _opt(None, "the node's ZeroMQ endpoint for this agent's reports and "
                                     "commands; none: standalone")
    error_file: str | None = _opt(None, "where a failing agent writes its error as JSON")
    threads: int = _opt(0, "torch intra-op threads; 0 = share the machine's cores between agents")
    join_from: int = _opt(0, "join a running job that is growing from this many agents (resize)")
    standby: bool = _opt(False, "load the script and warm up, then wait for a join command (fast grows)")
    device_memory: int = _opt(0, "budget in bytes for replicated plus worker-private state on this device; "
                                 "private state beyond it is swapped to host between turns (0 = default policy)")
    snapshot_dir: str = _opt("", "keep each resize's snapshot here (host memory: tmpfs) until a step completed "
                                 "after it; '' = not kept")
    restore_epoch: int = _opt(0, "start from the snapshot of this resize in --snapshot-dir (falling back after "
                                 "a resize that failed half-way)")
    snapshot_every: str = _opt("0", "take a periodic snapshot into --snapshot-dir every this many steps (20) or "
                                    "seconds (30s), written in the background; 0 = none")
    restore_latest: bool = _opt(False, "start from the newest complete periodic snapshot in --snapshot-dir "
                                       "(from the beginning when there is none): recovering after a failure")
    # The agents stop there and wait for the command, so the resize happens at that step and not at
    # whichever boundary the command reaches.
    hold_at: tuple[int, ...] = _opt((), "stop after these steps for a resize the launcher scheduled "
                                        "(`elasticd run --scale-at`), and wait for its command")

    @property
    def layout(self) -> Layout:
        return Layout.of(self.workers, self.world, tuple(self.blocks))

    @property
    def hosted(self) -> list[int]:
        return self.layout.hosted(self.rank)

    def to_argv(self) -> list[str]:
        """The command line that `python -m elasticd.agent` parses back into this config."""
        argv: list[str] = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.default is not MISSING and (value == f.default or (f.default == () and not value)):
                continue
            flag = "--" + f.name.replace("_", "-")
            parse, write = _TYPES[f.type]
            argv += [flag] if parse is bool else [flag, write(value)]
        return argv


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m elasticd.agent",
                                description="elasticd agent: one process per (job, device)")
    for f in dataclasses.fields(AgentConfig):
        flag, kind = "--" + f.name.replace("_", "-"), _TYPES[f.type][0]
        if kind is bool:
            p.add_argument(flag, action="store_true", help=f.metadata["help"])
        elif f.default is MISSING:
            p.add_argument(flag, type=kind, required=True, help=f.metadata["help"])
        else:
            p.add_argument(flag, type=kind, default=f.default, choices=f.metadata["choices"],
                           help=f.metadata["help"])
    return p


def parse_args(argv: list[str] | None = None) -> AgentConfig:
    p = _parser()
    cfg = AgentConfig(**vars(p.parse_args(argv)))
    if cfg.restore_epoch and not cfg.snapshot_dir:
        p.error("--restore-epoch needs --snapshot-dir")
    if cfg.restore_latest and not cfg.snapshot_dir:
        p.error("--restore-latest needs --snapshot-dir")
    try:
        Every.parse(cfg.snapshot_every)
    except ValueError as e:
        p.error(str(e))
    try:
        cfg.hosted  # noqa: B018 - computing the layout validates it
    except ValueError as e:
        p.error(str(e))
    return cfg
