"""Speed-aware placement, the scheduler's side: what it learns of its devices' speeds and what it does
about it.

The model (elasticd.placement: `CostModel`, the placer, `RelayoutGate`) is pure policy; this class feeds
it from node reports and asks it three things:
- which block sizes a job gets on the devices it was given (at launch, and for every grow, shrink or
  drain): `blocks_for`. The uniform layout of before (`[]`) whenever the model sees no gain in another,
  so an island of equal, unmeasured devices behaves exactly as it did without this;
- whether a running job should be re-laid-out on its own devices because measured speeds drifted (a
  straggler appeared or went away): `relayouts`, gated by the hysteresis so a job does not oscillate;
- what `status` shows: each device's fitted speed, a job's blocks, predicted vs measured step time.

Observations. Every agent reports, in its node's heartbeats, the timing of its latest steps (AgentStep
`timing`: hosted workers, compute seconds per step summed over them, flush seconds per step, and the
step count the means cover), tagged by its node with a sequence number so a heartbeat repeating the same
timing is not counted twice. Compute per hosted worker is what measures a device: the fast agent's wait
for the slow one lands in its flush time, not its compute. Every agent's flush time goes to the model,
which reads the job's communication cost from the lowest of them (the slowest agent waits for nobody, so
its flush is the collective alone).

Device keys are elasticd.placement's `device_key(node, device_id)`, e.g. "n1/cpu:0".

Pure like the state that holds it: `now` is passed in; no sockets, clocks or files.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from elasticd import protocol as p
from elasticd.placement import CostModel, Placement, RelayoutGate, block_sizes, device_key, uniform_sizes

log = logging.getLogger(__name__)

MIN_RELAYOUT_STEPS = 3     # agents' timing must cover this many steps before it moves a job


def sizes(blocks: list[int], workers: int, devices: int) -> list[int]:
    """A job's blocks, the uniform layout spelled out when empty."""
    return list(blocks) if blocks else uniform_sizes(workers, devices)


@dataclass(frozen=True, slots=True)
class Relayout:
    """A live re-layout the gate let through: same devices, `blocks` instead of the job's."""

    job_id: str
    blocks: list[int]
    gain: float            # predicted step time saved, as a fraction of the current prediction
    predicted_s: float     # of the new layout
    current_s: float       # of the layout it replaces
    reason: str


class Speeds:
    """The island's cost model and re-layout gate (persisted with the job table)."""

    def __init__(self, costs: CostModel | None = None, gate: RelayoutGate | None = None) -> None:
        self.costs = costs or CostModel()
        self.gate = gate or RelayoutGate()
        self.dirty = False                               # changed since last persisted
        self._seen: dict[tuple[str, int], int] = {}      # (job, agent pid) -> timing seq counted
        # job -> rank -> (device key, timing) of its agents' latest reports (all in: a re-layout may be due)
        self._latest: dict[str, dict[int, tuple[str, dict[str, Any]]]] = {}
        self._fresh: set[str] = set()                    # jobs with timing news since their last check

    # --- what is declared and measured ----------------------------------------------------------------

    def declare(self, node: str, devices: list[p.DeviceInfo]) -> None:
        """A node's declared device speeds (`elasticd start --device-speed`): priors until measured."""
        for d in devices:
            if d.speed > 0:
                self.costs.set_prior(device_key(node, d.device_id), float(d.speed))
                self.dirty = True

    def observe(self, job_id: str, world: int, node: str, agents: list[p.AgentReport], now: float) -> None:
        """The timing in one node's report of a job's agents (`world`: the job's M)."""
        for a in agents:
            t = a.timing
            if not t or not a.alive or a.standby or a.left:
                continue
            seq = t.get("seq")
            if not isinstance(seq, int) or self._seen.get((job_id, a.pid)) == seq:
                continue
            self._seen[(job_id, a.pid)] = seq
            hosted, compute, steps = t.get("hosted"), t.get("compute_s"), t.get("steps")
            if not (isinstance(hosted, int) and hosted > 0 and _time(compute) and compute > 0
                    and isinstance(steps, int) and steps > 0):
                continue   # a node's report is input: what no agent would send is skipped, not raised on
            key = device_key(node, a.device_id)
            self.costs.observe_compute(key, float(compute) / hosted, now, job_id=job_id)
            flush = t.get("flush_s")
            if world > 1 and _time(flush):
                self.costs.observe_comm(job_id, world, float(flush), now)
            self._latest.setdefault(job_id, {})[a.rank] = (key, t)
            self._fresh.add(job_id)
            self.dirty = True

    def forget_job(self, job_id: str) -> None:
        """The job ended: its communication cost and latest timings go; device speeds stay."""
        self.costs.forget_job(job_id)
        self.gate.forget(job_id)
        self._latest.pop(job_id, None)
        self._fresh.discard(job_id)
        for key in [k for k in self._seen if k[0] == job_id]:
            del self._seen[key]
        self.dirty = True

    def expire(self, now: float) -> bool:
        """Learned slowdowns of devices idle for a while go (elasticd/placement/cost.py says why). True if
        any went: placements and growths may now take those devices."""
        gone = self.costs.expire(now)
        for device, speed in gone.items():
            log.info("device %s: its learned speed %.2f expired after %.0fs without a report; back to its declared "
                     "%.2f", device, speed, self.costs.stale_s, self.costs.speed(device))
            self.dirty = True
        return bool(gone)

    def relaid(self, job_id: str) -> None:
        """The job's layout changed: timings of the old one say nothing about the new one's waits."""
        self._latest.pop(job_id, None)
        self._fresh.discard(job_id)

    def speed(self, node: str, device_id: str) -> float:
        return self.costs.speed(device_key(node, device_id))

    # --- decisions ------------------------------------------------------------------------------------

    def best(self, job_id: str, workers: int, placement: list[list[str]]) -> Placement:
        return block_sizes(workers, [device_key(n, d) for n, d in placement], self.costs, job_id)

    def predict(self, job_id: str, workers: int, placement: list[list[str]], blocks: list[int]) -> float:
        return self.costs.predict_step(job_id, [(device_key(n, d), b) for (n, d), b in
                                                zip(placement, sizes(blocks, workers, len(placement)), strict=True)])

    def blocks_for(self, job_id: str, workers: int, placement: list[list[str]]) -> list[int]:
        """The layout a job gets on `placement`: `[]` (uniform) unless the model predicts a shorter step
        with another."""
        if len(placement) <= 1:
            return []
        best = self.best(job_id, workers, placement)
        if best.predicted_s >= self.predict(job_id, workers, placement, []):
            return []
        return best.layout()

    def relayout(self, job_id: str, workers: int, placement: list[list[str]], blocks: list[int],
                 now: float) -> Relayout | None:
        """Whether a running job should move to other block sizes on its own devices now. Checked once per
        fresh timing (once every agent of the job has reported one), so `patience` counts measurements, not
        clock ticks."""
        m = len(placement)
        latest = self._latest.get(job_id, {})
        if m <= 1 or job_id not in self._fresh or len(latest) < m:
            return None
        if any(int(t.get("steps", 0)) < MIN_RELAYOUT_STEPS for _k, t in latest.values()):
            return None
        self._fresh.discard(job_id)
        current = sizes(blocks, workers, m)
        best = self.best(job_id, workers, placement)
        proposed = best.sizes
        current_s = self.predict(job_id, workers, placement, blocks)
        go, gain = self.gate.check(job_id, current_s, best, now)
        self.dirty = True
        if not go or proposed == current:
            return None
        slow = min(range(m), key=lambda i: self.costs.speed(device_key(*placement[i])))
        fast = max(range(m), key=lambda i: self.costs.speed(device_key(*placement[i])))
        reason = (f"speeds drifted: {device_key(*placement[slow])} at "
                  f"{self.costs.speed(device_key(*placement[slow])):.2f}, {device_key(*placement[fast])} at "
                  f"{self.costs.speed(device_key(*placement[fast])):.2f}; blocks {current} -> {proposed}")
        return Relayout(job_id, best.layout(), round(gain, 4),
                        best.predicted_s, current_s, reason)

    def done(self, job_id: str, now: float) -> None:
        """A re-layout of the job started: the gate's cooldown runs from now."""
        self.gate.done(job_id, now)
        self.relaid(job_id)
        self.dirty = True

    # --- views ----------------------------------------------------------------------------------------

    def job_layout(self, job_id: str, workers: int, placement: list[list[str]], blocks: list[int],
                   steps_per_s: float) -> p.JobLayout | None:
        """`status JOB`'s view: each agent's device, workers, fitted speed; predicted vs measured step."""
        m = len(placement)
        if m == 0:
            return None
        per = sizes(blocks, workers, m)
        agents = []
        for rank, ((node, dev), n) in enumerate(zip(placement, per, strict=True)):
            key = device_key(node, dev)
            c = self.costs.worker_step_seconds(key, job_id)
            agents.append(p.LayoutAgent(rank=rank, device=key, workers=n, speed=round(self.costs.speed(key), 3),
                                        worker_step_s=round(c, 6) if c is not None else None))
        return p.JobLayout(agents=agents, predicted_step_s=round(self.predict(job_id, workers, placement, blocks), 6),
                           measured_step_s=round(1.0 / steps_per_s, 6) if steps_per_s > 0 else None,
                           comm_s=round(self.costs.comm_seconds(job_id, m), 6))

    # --- persistence ----------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"costs": self.costs.to_dict(), "gate": self.gate.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Speeds:
        """Raises:
            ValueError: a saved model this version cannot read.
        """
        costs, gate = d.get("costs"), d.get("gate")
        return cls(CostModel.from_dict(costs) if costs else None, RelayoutGate.from_dict(gate) if gate else None)


def _time(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
