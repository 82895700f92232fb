"""An island's scheduler core (elasticd/scheduler/state.py) driven by hand with a fake clock, playing the
nodes' side of the protocol: what it sends back is returned for the test to check."""

from __future__ import annotations

from elasticd import protocol as p
from elasticd.scheduler.jobs import Job, JobState
from elasticd.scheduler.state import Config, SchedulerState, SendToNode


class Island:
    """A scheduler plus helpers to play the nodes' side of the protocol."""

    def __init__(self, jobs: list[Job] | None = None, **cfg) -> None:
        self.now = 100.0
        self.s = SchedulerState(jobs, now=self.now, config=Config(**cfg))
        self.sent: list[SendToNode] = []

    def _take(self, out: list[SendToNode]) -> list[SendToNode]:
        self.sent += out
        self.s.validate()
        return out

    def hello(self, node: str, devices: int, jobs: list[p.JobReport] | None = None) -> list[SendToNode]:
        devs = [p.DeviceInfo(device_id=f"cpu:{i}", type="cpu", index=i) for i in range(devices)]
        return self._take(self.s.node_hello(p.NodeHello(node_id=node, host=f"{node}.host", devices=devs,
                                                        jobs=jobs or []), self.now))

    def report(self, node: str, *reports: p.JobReport) -> list[SendToNode]:
        return self._take(self.s.node_status(p.NodeStatus(node_id=node, jobs=list(reports)), self.now))

    def submit(self, workers: int = 2, lo: int = 1, hi: int = 0, prio: int = 0) -> tuple[str, list[SendToNode]]:
        job, out = self.s.submit(p.Submit(script="/s.py", workers=workers, min_devices=lo, max_devices=hi,
                                          priority=prio), self.now)
        return job.job_id, self._take(out)

    def tick(self, dt: float) -> list[SendToNode]:
        self.now += dt
        return self._take(self.s.tick(self.now))

    def state(self, job_id: str) -> JobState:
        return self.s.jobs[job_id].state


def launches(out: list[SendToNode]) -> list[tuple[str, p.LaunchJob]]:
    return [(a.node_id, a.msg) for a in out if isinstance(a.msg, p.LaunchJob)]


def kills(out: list[SendToNode]) -> list[tuple[str, str]]:
    return [(a.node_id, a.msg.job_id) for a in out if isinstance(a.msg, p.KillJob)]


def rep(job: str, state: str, ranks=(0,), port: int = 0, ok: bool = True, **kw) -> p.JobReport:
    return p.JobReport(job_id=job, state=state, ranks=list(ranks), master_port=port, ok=ok, **kw)


def agent(rank: int, dev: int, alive: bool = True, **kw) -> p.AgentReport:
    return p.AgentReport(rank=rank, device_id=f"cpu:{dev}", pid=1000 + rank, alive=alive, connected=True, **kw)


def report(job: str, agents: list[p.AgentReport], state: str = "running", **kw) -> p.JobReport:
    return p.JobReport(job_id=job, state=state, ranks=sorted(a.rank for a in agents), agents=agents, **kw)


def resized(epoch: int, seconds: float, step: int | None = None, world: int = 1) -> p.ResizedInfo:
    """What the lead agent reports of a finished resize (its node fills in the epoch)."""
    return p.ResizedInfo(epoch=epoch, world=world, rank=0, left=False, seconds=seconds, blocks="", step=step)


def of(out, kind):
    return [(a.node_id, a.msg) for a in out if isinstance(a.msg, kind)]


def running_job(isl: Island, node: str = "a", devices: int = 4, workers: int = 4, lo: int = 1, hi: int = 0,
                prio: int = 0) -> str:
    job, out = isl.submit(workers=workers, lo=lo, hi=hi or devices, prio=prio)
    if not launches(out):
        return job
    isl.report(node, report(job, [agent(r, r) for r in range(devices)], master_port=1234))
    assert isl.state(job) is JobState.RUNNING
    return job


def complete(isl: Island, node: str, job: str, epoch: int, new: int, old: int) -> None:
    """Play the node's side of a whole single-node resize."""
    base = [agent(r, r) for r in range(max(new, old))]
    isl.report(node, report(job, [a for a in base if a.rank < old] +
                            [agent(r, r, standby=True) for r in range(old, new)], resize_epoch=epoch, resize_port=5))
    isl.report(node, report(job, [agent(r, r, epoch=epoch, stepped=epoch, left=r >= new) for r in range(max(new, old))],
                            resize_epoch=epoch))
    isl.report(node, report(job, [agent(r, r, epoch=epoch, stepped=epoch) for r in range(new)], resize_epoch=epoch))
