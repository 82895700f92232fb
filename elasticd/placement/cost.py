"""The learned cost model: seconds per logical worker-step of each device, and each job's flush cost per M.

Pure: no I/O, no clock of its own (`now` is passed in), state as msgpack-able dicts.

Why a windowed median, not a mean: step times on shared machines are noisy and have one-off spikes (a
neighbour's burst, a page-cache miss). The median of the last `window` observations ignores a spike
outright, yet a real change (a straggler appearing or going away) moves it after ceil(window/2)
observations: three with the default window of 5.

Why compute is kept per (job, device): seconds per worker-step of a small MLP and of a transformer differ by
orders of magnitude, so a device's seconds measured under one job say nothing absolute about another job.
What carries over between jobs is the device's *relative speed*: within one job running on several devices
the work per worker-step is the same everywhere, so the ratios of their step times are their speed ratios.
The least slowed device of a job is taken to run at its declared (prior) speed; slowdowns are what we learn
(throttling, a shared core), and a job on one device teaches no ratio, so it leaves the speeds as they were.

Why a dead band: a device measured within `deadband` (10%) of the job's healthy devices keeps its declared
speed. Medians of noisy reports differ by a few percent between equal devices, and a placer that believed
them would give equal devices unequal blocks and take extra devices for gains that are only noise (in the
trace simulator, +-10% report noise cost 16% mean JCT on a uniform fleet without the band). A slowdown
smaller than the band is not worth a re-layout anyway (the re-layout gate asks for 10%).

Why a learned slowdown expires (after `stale_s`, 10 minutes by default, without a report from the device):
what slowed a device (a neighbour on a shared core, throttling, scheduling noise around very short steps)
may be gone by the time it is idle, and nothing idle is measured, so a slowdown kept forever would keep
growths and new jobs off a healthy device for good. Forgotten, the device is back at its declared speed; if
it is still slow, the next job on it teaches so again within three reports and the re-layout gate moves
work off it.

Why the flush cost is read from the lower part of the reports: a physical collective ends for every agent
when the last one arrives, so an agent that got there early reports its wait for the straggler as flush
time. The agent that arrived last reports the collective alone, and it is the lowest of a round's M
reports.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

DeviceKey = str   # "NODE_ID/DEVICE", e.g. "n1/cpu:0": see device_key
FORMAT = 1
WINDOW = 5
DEADBAND = 0.10
STALE_S = 600.0


def device_key(node: str, device: str) -> DeviceKey:
    """The key of a node's device in the cost model (both #15 halves build it here, never by hand)."""
    return f"{node}/{device}"


def ring_shape(devices: int) -> float:
    """Relative cost of a ring all-reduce over `devices` (bytes each agent sends): 2(M-1)/M."""
    return 0.0 if devices <= 1 else 2.0 * (devices - 1) / devices


def _positive(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return value


def _finite(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return value


def _nonnegative(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return value


def _push(window: list[float], value: float, size: int) -> None:
    window.append(value)
    del window[:-size]


def _low_median(values: Iterable[float], devices: int) -> float:
    """Median of the lowest 1/devices of the values: one report per round is the collective alone."""
    ordered = sorted(values)
    keep = max(1, len(ordered) // max(1, devices))
    return statistics.median(ordered[:keep])


class CostModel:
    """Learned per-device seconds per logical worker-step, and per-job communication seconds as a function of M.

    Before a job has reported anything its predictions are in reference units (a speed-1.0 device takes 1.0
    per worker-step, no communication): enough to compare layouts, which is all the placer needs.
    """

    def __init__(self, priors: dict[DeviceKey, float] | None = None, window: int = WINDOW,
                 deadband: float = DEADBAND, stale_s: float = STALE_S) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if not (math.isfinite(deadband) and 0 <= deadband < 1):
            raise ValueError(f"deadband must be in [0, 1), got {deadband}")
        self.window = window
        self.deadband = float(deadband)
        self.stale_s = _positive("stale_s", stale_s)
        self._priors: dict[DeviceKey, float] = {}
        self._speeds: dict[DeviceKey, float] = {}                 # learned relative speeds
        self._compute: dict[str, dict[DeviceKey, list[float]]] = {}  # job -> device -> recent s/worker-step
        self._comm: dict[str, dict[int, list[float]]] = {}         # job -> M -> recent flush seconds
        self._last_job: dict[DeviceKey, str] = {}                  # the job that last reported on a device
        self._seen: dict[DeviceKey, float] = {}                    # when a device last reported
        for device, speed in (priors or {}).items():
            self.set_prior(device, speed)

    # -- input ---------------------------------------------------------------------------------------------
    def set_prior(self, device: DeviceKey, speed: float) -> None:
        """Declared relative speed of `device` (1.0 = reference), used until measurements say otherwise."""
        self._priors[str(device)] = _positive("device speed", speed)

    def observe_compute(self, device: DeviceKey, seconds_per_worker_step: float, now: float,
                        job_id: str = "") -> None:
        """One report: `device` took this many seconds per hosted logical worker per step, running `job_id`.

        Pass the job: without it every report is taken to come from one and the same job, which is only
        right while the island runs one job at a time.

        Raises:
            ValueError: on a time that is not a finite positive number (the model is left unchanged).
        """
        value = _positive("seconds_per_worker_step", seconds_per_worker_step)
        device, job_id, now = str(device), str(job_id), _finite("now", now)
        _push(self._compute.setdefault(job_id, {}).setdefault(device, []), value, self.window)
        self._last_job[device] = job_id
        self._seen[device] = now
        self._learn_speeds(job_id)

    def observe_comm(self, job_id: str, devices: int, seconds: float, now: float) -> None:
        """One agent's mean flush seconds per step while `job_id` ran on `devices` agents (pass every agent's).

        Raises:
            ValueError: on a negative or non-finite time or a device count < 1.
        """
        value = _nonnegative("flush seconds", seconds)
        _finite("now", now)
        if int(devices) < 1:
            raise ValueError(f"devices must be >= 1, got {devices}")
        if devices == 1:
            return   # one agent flushes locally: no physical collective to learn
        size = self.window * int(devices)   # a round brings one report per agent
        _push(self._comm.setdefault(str(job_id), {}).setdefault(int(devices), []), value, size)

    def expire(self, now: float) -> dict[DeviceKey, float]:
        """Forget the learned speeds of devices that have not reported for `stale_s` (module docstring);
        returns what was forgotten (device -> the speed it had)."""
        now = _finite("now", now)
        gone = {d: v for d, v in self._speeds.items() if now - self._seen.get(d, now) >= self.stale_s}
        for d in gone:
            del self._speeds[d]
        return gone

    def forget_job(self, job_id: str) -> None:
        """Drop what is specific to a finished job; the device speeds it taught are kept (until `expire`)."""
        self._compute.pop(job_id, None)
        self._comm.pop(job_id, None)
        for device in [d for d, j in self._last_job.items() if j == job_id]:
            del self._last_job[device]

    def _learn_speeds(self, job_id: str) -> None:
        # Only windows at least half full: the median of fewer reports can be a spike, and a speed learned
        # from one would steer other jobs' placements away from a healthy device.
        settled = (self.window + 1) // 2
        fits = {d: statistics.median(w) for d, w in self._compute[job_id].items() if len(w) >= settled}
        if len(fits) < 2:
            return   # one device shows no ratio
        at_prior = {d: c * self.prior(d) for d, c in fits.items()}   # the job's work, if d ran at its prior
        least = min(at_prior.values())
        healthy = statistics.median(w for w in at_prior.values() if w <= least / (1 - self.deadband))
        for device, c in fits.items():
            if healthy / at_prior[device] >= 1 - self.deadband:
                self._speeds.pop(device, None)   # as declared: a slowdown it had is gone
            else:
                self._speeds[device] = healthy / c

    # -- output --------------------------------------------------------------------------------------------
    def prior(self, device: DeviceKey) -> float:
        return self._priors.get(device, 1.0)

    def speed(self, device: DeviceKey) -> float:
        """Relative speed: fitted, else prior, else 1.0."""
        return self._speeds.get(device, self._priors.get(device, 1.0))

    def worker_step_seconds(self, device: DeviceKey, job_id: str | None = None) -> float | None:
        """Fitted seconds per worker-step on `device` for `job_id` (default: the job that last reported
        there); None when nothing was measured."""
        job = self._last_job.get(device) if job_id is None else job_id
        window = self._compute.get(job, {}).get(device) if job is not None else None
        return statistics.median(window) if window else None

    def work(self, job_id: str) -> float:
        """Seconds per worker-step of `job_id` on a speed-1.0 device (1.0 before it reported anything)."""
        fits = [statistics.median(w) * self.speed(d) for d, w in self._compute.get(job_id, {}).items() if w]
        return statistics.median(fits) if fits else 1.0

    def estimate(self, job_id: str, device: DeviceKey) -> float:
        """Seconds per worker-step of `job_id` on `device`: the job's work over the device's speed.

        Also on a device the job measured: its raw median differs from its equals' by noise (see the dead
        band), which `worker_step_seconds` shows as measured.
        """
        return self.work(job_id) / self.speed(device)

    def estimates(self, job_id: str, devices: Iterable[DeviceKey]) -> dict[DeviceKey, float]:
        """`estimate` for many devices at once (the job's work is fitted once)."""
        work = self.work(job_id)
        return {d: work / self.speed(d) for d in devices}

    def comm_seconds(self, job_id: str, devices: int) -> float:
        """Flush seconds per step of `job_id` on `devices` agents; 0.0 when M == 1 or nothing is known.

        Seen M: its own estimate. Unseen M: a + b*2(M-1)/M fitted to the M seen (least squares, a, b >= 0);
        with one M seen, that point scaled along the ring shape.
        """
        if devices <= 1:
            return 0.0
        seen = {m: _low_median(w, m) for m, w in self._comm.get(job_id, {}).items() if w}
        if not seen:
            return 0.0
        if devices in seen:
            return seen[devices]
        if len(seen) == 1:
            (m0, v0), = seen.items()
            return v0 * ring_shape(devices) / ring_shape(m0)
        a, b = _fit_line([(ring_shape(m), v) for m, v in sorted(seen.items())])
        return max(0.0, a + b * ring_shape(devices))

    def predict_step(self, job_id: str, blocks: list[tuple[DeviceKey, int]]) -> float:
        """Predicted step seconds of `job_id` laid out as `blocks`: the busiest device plus the flush.

        Raises:
            ValueError: on an empty layout or a block size < 1.
        """
        if not blocks:
            raise ValueError("a layout needs at least one block")
        if any(n < 1 for _d, n in blocks):
            raise ValueError(f"block sizes must be >= 1, got {[n for _d, n in blocks]}")
        c = self.estimates(job_id, (d for d, _n in blocks))
        busiest = max(n * c[d] for d, n in blocks)
        return busiest + self.comm_seconds(job_id, len(blocks))

    def devices(self) -> list[DeviceKey]:
        """Every device the model knows anything about, sorted."""
        return sorted(set(self._priors) | set(self._speeds) | set(self._last_job) | set(self._seen))

    # -- persistence ---------------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {
            "format": FORMAT, "window": self.window, "deadband": self.deadband, "stale_s": self.stale_s,
            "priors": dict(self._priors), "speeds": dict(self._speeds),
            "compute": {j: {d: list(w) for d, w in ws.items()} for j, ws in self._compute.items()},
            "comm": {j: {str(m): list(w) for m, w in ws.items()} for j, ws in self._comm.items()},
            "last_job": dict(self._last_job), "seen": dict(self._seen),
        }

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        """Raises:
            ValueError: on a dict this version did not write (bad format, types or values).
        """
        try:
            if d.get("format") != FORMAT:
                raise ValueError(f"cost model format {d.get('format')!r}, this version reads {FORMAT}")
            model = cls(window=int(d["window"]), deadband=float(d.get("deadband", DEADBAND)),  # older saves
                        stale_s=float(d.get("stale_s", STALE_S)))
            for device, speed in d["priors"].items():
                model.set_prior(device, speed)
            model._speeds = {str(k): _positive("speed", v) for k, v in d["speeds"].items()}
            model._compute = {str(j): {str(dev): [_positive("compute", x) for x in w] for dev, w in ws.items()}
                              for j, ws in d["compute"].items()}
            model._comm = {str(j): {int(m): [_nonnegative("comm", x) for x in w] for m, w in ws.items()}
                           for j, ws in d["comm"].items()}
            model._last_job = {str(k): str(v) for k, v in d["last_job"].items()}
            model._seen = {str(k): float(v) for k, v in d["seen"].items()}
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"malformed cost model: {exc!r}") from exc
        return model


def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares v = a + b*x with a, b >= 0 (a negative part is clamped and the other refitted)."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    mv = sum(v for _, v in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = sum((x - mx) * (v - mv) for x, v in points) / sxx if sxx > 0 else 0.0
    a = mv - b * mx
    if b < 0:
        return mv, 0.0
    if a < 0:
        sx2 = sum(x * x for x, _ in points)
        return 0.0, sum(x * v for x, v in points) / sx2 if sx2 > 0 else 0.0
    return a, b
