"""Losing a whole island under a job spanning two, beside losing one node under a job on one island.

The job is scripts/_benchjob.py (an MLP on synthetic data, N=8 logical workers, SGD with momentum,
`--snapshot-every K` steps) on 4 CPU devices in both set-ups, everything on loopback TCP with CURVE:

- one island: a scheduler with two node daemons of 2 devices each (`--min-devices 2`); once a periodic
  snapshot is complete, the second node's daemon and its agents are SIGKILLed. The island's scheduler
  recovers the job on the node left (elasticd/scheduler/recovery.py);
- two islands: a federation front, two island schedulers, one node of 2 devices each, the job submitted
  with `--islands A,B`; island B's scheduler, daemon and agents are SIGKILLed. The front restarts the job on
  island A alone from its newest complete snapshot, whose parts of B's workers A holds as copies
  (elasticd/federation/spans.py).

Both wait for the same silence before they act: the node timeout of the one, the island timeout of the
other (both `--timeout`), with heartbeats every 0.1 s. The figure is wall time from the kill to the
first step the job completes after it (its step moving past the one its restart first reported, read
from the scheduler's and the front's status every 0.02 s). Rounds alternate which set-up runs first.

The last line is `island_loss_vs_node_loss=X.XX`: the median resume time of the two-island job over the
one-island job's.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
from _benchdaemon import wait_for
from _benchjob_common import JOB, REPO, BenchError, elasticd_cmd, load_average, median, table, tempdir, unpin

from elasticd import protocol as pr
from elasticd.control_client import Client, Target

WORKERS = 8


def _parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--every", type=int, default=5, help="K: a periodic snapshot every K steps (default 5)")
    ap.add_argument("--timeout", type=float, default=2.0, help="node and island timeout, seconds (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of both set-ups (default 3)")
    ap.add_argument("--quick", action="store_true", help="smoke run: one round")
    a = ap.parse_args()
    if a.quick:
        a.repeats = 1
    return a


class Procs:
    """The processes of one set-up, each in its own session, killed with their agents at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str, info: str) -> dict:
        sd = self.root / name
        sd.mkdir(parents=True, exist_ok=True)
        with open(self.root / f"{name}.out", "wb") as out:
            self.procs[name] = subprocess.Popen(
                elasticd_cmd(*args, "--state-dir", str(sd), "--log-level", "INFO"), cwd=REPO, stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=unpin,
                env={k: v for k, v in os.environ.items() if k != "ELASTICD_FORKSERVER_DIR"})
        return wait_for(lambda: self._info(name, info), 90, f"{name} to serve")

    def _info(self, name: str, info: str) -> dict | None:
        proc = self.procs[name]
        if proc.poll() is not None:
            raise BenchError(f"{name} exited with {proc.returncode}:\n{(self.root / f'{name}.out').read_text()[-3000:]}")
        try:
            d = json.loads((self.root / name / info).read_text())
        except (OSError, ValueError):
            return None
        return d if d.get("pid") == proc.pid else None

    def cli(self, *args: str) -> str:
        r = subprocess.run(elasticd_cmd(*args), cwd=REPO, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise BenchError(f"elasticd {' '.join(args)}: exit {r.returncode}\n{r.stdout}{r.stderr}")
        return r.stdout

    def scheduler(self, name: str, *extra: str) -> dict:
        return self.start(name, "scheduler", "--bind", "tcp://127.0.0.1:0", "--heartbeat", "0.1", "--node-timeout",
                          str(ARGS.timeout), *extra, info="scheduler.json")

    def node(self, sched: str, name: str) -> None:
        key = self.cli("keygen", "--state-dir", str(self.root / name)).strip()
        self.cli("keygen", "--state-dir", str(self.root / sched), "--allow", key, "--role", "node", "--node-id", name)
        info = json.loads((self.root / sched / "scheduler.json").read_text())
        self.start(name, "start", "--cpu-devices", "2", "--heartbeat", "0.1", "--scheduler", info["tcp"],
                   "--scheduler-key", info["public_key"], "--node-id", name, info="daemon.json")

    def kill(self, *names: str) -> None:
        """SIGKILL these processes and every agent they started, at once (a machine, or an island, gone)."""
        victims: list[psutil.Process] = []
        for name in names:
            try:
                victims += [psutil.Process(self.procs[name].pid), *psutil.Process(self.procs[name].pid).children(True)]
            except psutil.Error:
                pass
        for v in victims:
            try:
                v.kill()
            except psutil.Error:
                pass

    def close(self) -> None:
        self.kill(*self.procs)
        for proc in self.procs.values():
            proc.wait(timeout=30)


def _env_args(steps: int) -> list[str]:
    env = {"ELASTICD_BENCH_WORKERS": WORKERS, "ELASTICD_BENCH_STEPS": steps, "ELASTICD_BENCH_WIDTH": 256}
    return [x for k, v in env.items() for x in ("--env", f"{k}={v}")]


def _ask(sock: Path, msg):
    with Client(Target(f"ipc://{sock}", what=str(sock))) as c:
        return c.request(msg)


def _snapshot(job) -> bool:
    if job.state in ("failed", "stopped"):
        raise BenchError(f"job {job.job_id} {job.state}: {job.error}")
    return (job.snapshot or {}).get("step", 0) >= ARGS.every


def _resumed(read, killed_at: float) -> float:
    """Seconds from the kill to the first step the restarted job completes. `read()`: the job's (state, step)."""
    def seen(pred, what: str):
        while not (got := pred(read())):
            if time.time() - killed_at > 120:
                raise BenchError(f"no {what} within 120 s of the kill")
            time.sleep(0.02)
        return got
    seen(lambda st: st[0] != "running" or None, "sign of the failure")
    (first,) = seen(lambda st: (st[1],) if st[0] == "running" else None, "restart")
    seen(lambda st: st[0] == "running" and st[1] > first, "step after the restart")
    return time.time() - killed_at


def one_island(root: Path, steps: int) -> float:
    p = Procs(root)
    try:
        p.scheduler("sched")
        p.node("sched", "n1")
        p.node("sched", "n2")
        sd = str(root / "sched")
        ssock = root / "sched" / "scheduler.sock"
        wait_for(lambda: sorted(len(n.free) for n in _ask(ssock, pr.Status()).nodes) == [2, 2], 90,
                 "both nodes to offer their devices")
        job = p.cli("submit", f"{JOB}:train", "--workers", str(WORKERS), "--min-devices", "2", "--max-devices", "4",
                    "--snapshot-every", str(ARGS.every), "--state-dir", sd, *_env_args(steps)).strip()

        def info():
            return _ask(root / "sched" / "scheduler.sock", pr.Status(job_id=job)).jobs[0]

        wait_for(lambda: _snapshot(info()) and info().devices == 4, 120, "a periodic snapshot on 4 devices")
        killed_at = time.time()
        p.kill("n2")
        return _resumed(lambda: (info().state, info().step), killed_at)
    finally:
        p.close()


def two_islands(root: Path, steps: int) -> float:
    p = Procs(root)
    try:
        front = p.start("front", "federation", "--bind", "tcp://127.0.0.1:0", "--island-timeout", str(ARGS.timeout),
                        info="federation.json")
        for isl, node in (("A", "a1"), ("B", "b1")):
            key = p.cli("keygen", "--state-dir", str(root / isl)).strip()
            p.cli("keygen", "--state-dir", str(root / "front"), "--allow", key, "--role", "island", "--island-id", isl)
            p.scheduler(isl, "--federation", front["tcp"], "--federation-key", front["public_key"], "--island-id", isl)
            p.node(isl, node)
        fsock = root / "front" / "federation.sock"

        def islands() -> dict:
            return {i.island_id: i.capacity.free for i in _ask(fsock, pr.ListIslands()).islands}
        wait_for(lambda: islands() == {"A": 2, "B": 2}, 60, "both islands up")
        span = p.cli("submit", f"{JOB}:train", "--workers", str(WORKERS), "--islands", "A,B", "--snapshot-every",
                     str(ARGS.every), "--state-dir", str(root / "front"), *_env_args(steps)).strip()

        def portion_a():
            return _ask(root / "A" / "scheduler.sock", pr.Status()).jobs[-1]   # its newest: the restart's

        def read() -> tuple[str, int]:
            s = _ask(fsock, pr.ListSpans(span_id=span)).spans[0]
            return (s.state, portion_a().step) if s.state == "running" else (s.state, -1)

        wait_for(lambda: _snapshot(portion_a()), 120, "a periodic snapshot")
        killed_at = time.time()
        p.kill("B", "b1")
        return _resumed(read, killed_at)
    finally:
        p.close()


def main() -> None:
    rows, times = [], {"one island, node lost": [], "two islands, island lost": []}
    steps = 100_000   # never ends on its own: each round kills it
    for r in range(ARGS.repeats):
        order = [("one island, node lost", one_island), ("two islands, island lost", two_islands)]
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            with tempdir() as tmp:
                s = fn(Path(tmp), steps)
            times[name].append(s)
            rows.append([str(r + 1), name, f"{s:.2f}"])
            print(f"round {r + 1}: {name}: a step completed {s:.2f}s after the kill", flush=True)
    print(table(["round", "set-up", "kill -> first step after (s)"], rows))
    print(f"timeouts {ARGS.timeout:.1f}s, snapshots every {ARGS.every} steps; load {load_average()}")
    one, two = median(times["one island, node lost"]), median(times["two islands, island lost"])
    print(f"median: one island {one:.2f}s, two islands {two:.2f}s")
    print(f"island_loss_vs_node_loss={two / one:.2f}")


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.default_int_handler)
    ARGS = _parse()
    main()
