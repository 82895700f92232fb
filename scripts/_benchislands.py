"""Set-ups of the island benchmarks: federation fronts, island schedulers and node daemons as processes on
loopback TCP with CURVE, each in its own session, and the job they run (scripts/_benchjob.py)."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
from _benchdaemon import wait_for
from _benchjob_common import REPO, BenchError, elasticd_cmd, tempdir, unpin

from elasticd import protocol as pr
from elasticd.control_client import Client, Target

WORKERS = 8


class Procs:
    """The processes of one set-up, each in its own session, killed with their agents at the end."""

    def __init__(self, root: Path, timeout: float) -> None:
        self.root, self.timeout = root, timeout
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
                          str(self.timeout), *extra, info="scheduler.json")

    def node(self, sched: str, name: str) -> None:
        key = self.cli("keygen", "--state-dir", str(self.root / name)).strip()
        self.cli("keygen", "--state-dir", str(self.root / sched), "--allow", key, "--role", "node", "--node-id", name)
        info = json.loads((self.root / sched / "scheduler.json").read_text())
        self.start(name, "start", "--cpu-devices", "2", "--heartbeat", "0.1", "--scheduler", info["tcp"],
                   "--scheduler-key", info["public_key"], "--node-id", name, info="daemon.json")

    def one_island(self) -> None:
        """A scheduler ("sched") with two nodes of 2 devices each (n1, n2), both offering their devices."""
        self.scheduler("sched")
        self.node("sched", "n1")
        self.node("sched", "n2")
        sock = self.root / "sched" / "scheduler.sock"
        wait_for(lambda: sorted(len(n.free) for n in ask(sock, pr.Status()).nodes) == [2, 2], 90,
                 "both nodes to offer their devices")

    def two_islands(self) -> None:
        """A federation front ("front") and islands A and B, one node of 2 devices each (a1, b1), both up."""
        front = self.start("front", "federation", "--bind", "tcp://127.0.0.1:0", "--island-timeout",
                           str(self.timeout), info="federation.json")
        for isl, node in (("A", "a1"), ("B", "b1")):
            key = self.cli("keygen", "--state-dir", str(self.root / isl)).strip()
            self.cli("keygen", "--state-dir", str(self.root / "front"), "--allow", key, "--role", "island",
                     "--island-id", isl)
            self.scheduler(isl, "--federation", front["tcp"], "--federation-key", front["public_key"], "--island-id",
                           isl)
            self.node(isl, node)
        sock = self.root / "front" / "federation.sock"
        wait_for(lambda: {i.island_id: i.capacity.free for i in ask(sock, pr.ListIslands()).islands} == {"A": 2, "B": 2},
                 60, "both islands up")

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


def env_args(steps: int) -> list[str]:
    env = {"ELASTICD_BENCH_WORKERS": WORKERS, "ELASTICD_BENCH_STEPS": steps, "ELASTICD_BENCH_WIDTH": 256}
    return [x for k, v in env.items() for x in ("--env", f"{k}={v}")]


def ask(sock: Path, msg):
    with Client(Target(f"ipc://{sock}", what=str(sock))) as c:
        return c.request(msg)


def alternating(repeats: int, setups: list[tuple[str, Callable[[Path, int], Any]]], steps: int
                ) -> Iterator[tuple[int, str, Any]]:
    """Each set-up once per round, in a fresh directory, the order reversed every other round (the machine's
    drift falls on both alike): (round from 1, set-up name, what it returned)."""
    for r in range(repeats):
        for name, fn in (setups if r % 2 == 0 else setups[::-1]):
            with tempdir() as tmp:
                yield r + 1, name, fn(Path(tmp), steps)
