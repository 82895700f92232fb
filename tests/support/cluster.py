"""Control-plane test helpers: condition waits, real daemons/schedulers as subprocesses, the CLI.

Every process started here runs in its own session and is killed (with the agents it spawned) at
teardown, whatever the test did.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import util
from util import cli, cli_here, wait_until

from elasticd.forked import SHARED_DIR_VAR

REPO = Path(__file__).resolve().parents[2]
FAKE_AGENT = REPO / "tests" / "jobs" / "fake_agent.py"



def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


@dataclass
class Proc:
    """A daemon or scheduler process with its state dir."""

    argv: list[str]
    state_dir: Path
    info_name: str
    popen: subprocess.Popen | None = None
    log: Path | None = None
    known_children: set[int] = field(default_factory=set)
    env: dict[str, str] = field(default_factory=dict)   # on top of ours

    def start(self) -> Proc:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log = self.state_dir.parent / f"{self.state_dir.name}.{self.info_name}.out"
        with open(self.log, "ab") as out:
            self.popen = subprocess.Popen([sys.executable, "-m", "elasticd", *self.argv], stdout=out,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=str(REPO),
                                          env={**os.environ, **self.env}, start_new_session=True)
        wait_until(self._ready, 30, what=f"{self.info_name} in {self.state_dir} to serve (log: {self.log})")
        return self

    def _ready(self) -> bool:
        assert self.popen is not None
        if self.popen.poll() is not None:
            raise AssertionError(f"{self.argv} exited with {self.popen.returncode}:\n{self.output()}")
        info = self.info()
        return bool(info and info.get("pid") == self.popen.pid)

    def info(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.state_dir / self.info_name).read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log and self.log.exists() else ""

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def agents(self) -> list[psutil.Process]:
        kids = _descendants(self.pid) if self.popen and self.popen.poll() is None else []
        self.known_children.update(k.pid for k in kids)
        return kids

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the process (not its agents, which live in their own sessions)."""
        if self.popen is None:
            return
        self.agents()
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            pass
        self.popen.wait(timeout=30)

    def cleanup(self) -> None:
        """Graceful stop if possible, then SIGKILL everything this process ever spawned."""
        if self.popen is None:
            return
        self.agents()
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.pid, signal.SIGKILL)
                self.popen.wait(timeout=10)
        for pid in self.known_children:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def daemon_argv(state_dir: Path, *extra: str, cpu: int | None = 2, fake: bool = True,
                heartbeat: float = 0.1) -> list[str]:
    """`cpu`: that many CPU devices; None: the daemon's default (every CUDA device, else one CPU device)."""
    argv = ["start", "--state-dir", str(state_dir), *(["--cpu-devices", str(cpu)] if cpu else []),
            "--heartbeat", str(heartbeat), "--node-timeout", "5", "--log-level", "DEBUG", *extra]
    if "--scheduler" not in extra and "--bind" not in extra:
        argv += ["--bind", "tcp://127.0.0.1:0"]
    if fake:
        argv += ["--agent-command", f"{sys.executable} {FAKE_AGENT}"]
    return argv


class Cluster:
    """The processes of one test, cleaned up together."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[Proc] = []

    def daemon(self, name: str = "node", *extra: str, cpu: int | None = 2, fake: bool = True,
               env: dict[str, str] | None = None, own_forks: bool = False) -> Proc:
        """A node daemon; one that embeds its scheduler (no `--scheduler`) is returned once its node has
        joined that scheduler, as `elasticd status` shows it (a node says hello once its spares' fork server
        is ready). One with real agents (not `fake`) takes that server from the test process's shared ones
        unless `own_forks` (a test that looks at the daemon's processes)."""
        sd = self.root / name
        shared = {SHARED_DIR_VAR: util.SHARED_DAEMON_FORK_SERVERS} if not fake and not own_forks else {}
        proc = Proc(daemon_argv(sd, *extra, cpu=cpu, fake=fake), sd, "daemon.json", env={**shared, **(env or {})})
        self.procs.append(proc)
        proc.start()
        if "--scheduler" not in extra:
            wait_until(lambda: status(sd)["nodes"], 90, what=f"daemon {name}'s node to join its scheduler")
        return proc

    def node(self, sched: Proc, name: str, *extra: str, cpu: int = 1, fake: bool = True,
             endpoint_key: str = "tcp", own_forks: bool = False) -> Proc:
        """A node daemon `name` (its node id too) joined over CURVE TCP to the scheduler `sched` serves (a
        standalone scheduler, or a daemon's embedded one with endpoint_key="scheduler_tcp"), its key allowed
        there with the node role."""
        pub = cli("keygen", "--state-dir", str(self.root / name)).out.strip()
        r = cli("keygen", "--state-dir", str(sched.state_dir), "--allow", pub, "--name", name, "--role", "node",
                "--node-id", name)
        assert r.code == 0, r.err
        info = sched.info()
        assert info is not None
        return self.daemon(name, "--scheduler", info[endpoint_key], "--scheduler-key",
                           str(sched.state_dir / "keys" / "id.key"), "--node-id", name, *extra, cpu=cpu, fake=fake,
                           own_forks=own_forks)

    def scheduler(self, name: str = "sched", *extra: str, bind: str = "tcp://127.0.0.1:0") -> Proc:
        sd = self.root / name
        proc = Proc(["scheduler", "--bind", bind, "--state-dir", str(sd), "--heartbeat", "0.1",
                     "--node-timeout", "5", "--log-level", "DEBUG", *extra], sd, "scheduler.json")
        self.procs.append(proc)
        return proc.start()

    def federation(self, name: str = "front", island_timeout: float = 2.0, *extra: str) -> Proc:
        sd = self.root / name
        proc = Proc(["federation", "--bind", "tcp://127.0.0.1:0", "--state-dir", str(sd), "--island-timeout",
                     str(island_timeout), "--log-level", "DEBUG", *extra], sd, "federation.json")
        self.procs.append(proc)
        return proc.start()

    def island(self, front: Proc, name: str, island_id: str | None = None, *, allow_as: str | None = None) -> Proc:
        """An island scheduler `name` joined to the front as `island_id` (default: `name`); its key is allowed
        on the front as the island `allow_as` (default: the id it claims)."""
        island_id = island_id or name
        pub = cli("keygen", "--state-dir", str(self.root / name)).out.strip()
        r = cli("keygen", "--state-dir", str(front.state_dir), "--allow", pub, "--name", name, "--role", "island",
                "--island-id", allow_as or island_id)
        assert r.code == 0, r.err
        info = front.info()
        assert info is not None
        return self.scheduler(name, "--federation", info["tcp"], "--federation-key", info["public_key"],
                              "--island-id", island_id)

    def cleanup(self) -> None:
        for proc in reversed(self.procs):
            proc.cleanup()


def status(state_dir: Path, job: str | None = None) -> dict[str, Any]:
    """`elasticd status --json`, run in the test's process (util.cli_here): tests poll it while they wait."""
    r = cli_here("status", "--json", "--state-dir", str(state_dir), *([job] if job else []))
    assert r.code == 0, (r.code, r.out, r.err)
    return r.json()


def job_state(state_dir: Path, job: str) -> str:
    return status(state_dir, job)["jobs"][0]["state"]


def wait_state(state_dir: Path, job: str, states: tuple[str, ...] | str, timeout: float = 60.0) -> dict[str, Any]:
    want = (states,) if isinstance(states, str) else states
    last: dict[str, Any] = {}

    def check() -> bool:
        nonlocal last
        last = status(state_dir, job)["jobs"][0]
        return last["state"] in want

    try:
        wait_until(check, timeout, interval=0.1, what=f"job {job} to be {'/'.join(want)}")
    except AssertionError as e:
        raise AssertionError(f"{e}; last seen: {json.dumps(last)[:2000]}") from None
    return last
