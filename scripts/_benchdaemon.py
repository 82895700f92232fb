"""A node daemon for the benchmarks: `elasticd start` in its own state dir, driven through the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _benchjob_common import REPO, BenchError, elasticd_cmd, unpin


def wait_for(pred: Callable[[], Any], timeout: float, what: str, interval: float = 0.1) -> Any:
    """pred()'s first true value, polled until `timeout` seconds have passed (then BenchError)."""
    deadline = time.monotonic() + timeout
    while not (value := pred()):
        if time.monotonic() > deadline:
            raise BenchError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
    return value


class BenchDaemon:
    """`elasticd start --cpu-devices N --bind none START_ARGS...` in `root` (created), its log in daemon.out."""

    def __init__(self, root: Path, devices: int, *start_args: str, env: dict[str, str] | None = None) -> None:
        self.sd = root
        self.sd.mkdir(parents=True)
        self.out = self.sd / "daemon.out"
        with open(self.out, "wb") as out:
            self.popen = subprocess.Popen(
                elasticd_cmd("start", "--cpu-devices", str(devices), "--bind", "none", *start_args,
                             "--state-dir", str(self.sd), "--log-level", "INFO"),
                cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=unpin, env={**os.environ, **(env or {})})
        wait_for(self._serving, 60, "the daemon to serve")

    def _serving(self) -> bool:
        if self.popen.poll() is not None:
            raise BenchError(f"the daemon exited with {self.popen.returncode}:\n{self.out.read_text()[-3000:]}")
        try:
            return json.loads((self.sd / "daemon.json").read_text()).get("pid") == self.popen.pid
        except (OSError, ValueError):
            return False

    def cli(self, *args: str) -> str:
        r = subprocess.run(elasticd_cmd(*args, "--state-dir", str(self.sd)), cwd=REPO, capture_output=True,
                           text=True, timeout=60)
        if r.returncode != 0:
            raise BenchError(f"elasticd {' '.join(args)}: exit {r.returncode}\n{r.stdout}{r.stderr}\n"
                             f"daemon log:\n{self.out.read_text()[-3000:]}")
        return r.stdout

    def job(self, job: str) -> dict[str, Any]:
        return json.loads(self.cli("status", job, "--json"))["jobs"][0]

    def close(self) -> None:
        if self.popen.poll() is None:
            subprocess.run(elasticd_cmd("shutdown", "--state-dir", str(self.sd)), capture_output=True, timeout=60)
            try:
                self.popen.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
