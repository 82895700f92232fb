"""A node's supervision core (elasticd/daemon/supervision.py) driven by hand, as its I/O shell would drive it:
made-up pids, hellos and exits at a given `now`."""

from __future__ import annotations

import itertools

from elasticd import protocol as p
from elasticd.daemon.actions import Spawn
from elasticd.daemon.devices import cpu_devices
from elasticd.daemon.supervision import Supervision

T0 = 1000.0
ERR = {"message": "ValueError: boom"}   # what an agent that died wrote to its error file


def hello_info(pid: int) -> p.AgentInfo:
    return p.AgentInfo(world=2, hosted=[0], pid=pid, host="h", device="cpu")


class Node:
    """The core plus the bookkeeping a shell would do: pids for spawns, identities for hellos."""

    def __init__(self, devices: int = 4) -> None:
        self.core = Supervision(cpu_devices(devices))
        self._pids = itertools.count(100)
        self.pid: dict[tuple[str, int], int] = {}

    def start(self, actions, fail_rank: int | None = None, now: float = T0) -> list:
        """Start every Spawn among `actions` as a shell would; the other actions come back."""
        rest, given_up = [], set()
        queue = list(actions)
        while queue:
            a = queue.pop(0)
            if not isinstance(a, Spawn):
                rest.append(a)
            elif a.job_id in given_up:
                continue
            elif a.rank == fail_rank:
                given_up.add(a.job_id)
                queue += self.core.spawn_failed(a, "no such file", now)
            else:
                pid = next(self._pids)
                self.core.started(a, pid, token_of(pid))
                self.pid[a.job_id, a.rank] = pid
        return rest

    def hello(self, job: str, rank: int) -> bytes:
        ident = f"{job}/{rank}/{self.pid[job, rank]}".encode()
        pid = self.pid[job, rank]
        err, actions = self.core.agent_message(ident, p.AgentHello(job_id=job, rank=rank, info=hello_info(pid),
                                                                   token=token_of(pid)), T0)
        assert err is None and actions == []
        return ident

    def exit(self, job: str, rank: int, code: int, now: float = T0) -> list:
        return self.core.exited(self.pid[job, rank], code, ERR, now)

    def report(self, job: str) -> p.JobReport:
        return next(r for r in self.core.reports({}) if r.job_id == job)


def launch_msg(job: str, ranks: int = 2, **kw) -> p.LaunchJob:
    return p.LaunchJob(job_id=job, script="/s.py", func=None, workers=4, devices=ranks,
                       placements=[p.RankPlacement(rank=r, device_id=f"cpu:{r}") for r in range(ranks)],
                       master_addr="10.0.0.1", master_port=0, **kw)


def running(node: Node, job: str = "j", ranks: int = 2) -> list[bytes]:
    assert node.start(node.core.launch(launch_msg(job, ranks), port=29500)) == []
    return [node.hello(job, r) for r in range(ranks)]


def token_of(pid: int) -> str:
    return f"token-of-{pid}"
