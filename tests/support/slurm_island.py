"""A real single-host Slurm for the deploy recipe's tests: munged, slurmctld and slurmd of Debian's
`slurm-wlm`, on free ports, in a directory of their own, with a node whose Slurm name is not the host
name (`NodeHostname=`), as on cloud clusters. Every daemon it starts is stopped by pid."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from elasticd.ports import free_port

NODE = "elnode1"   # the Slurm node name; the host's name is socket.gethostname()
NEEDED = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel")


def missing() -> str | None:
    """Why a real Slurm cannot run here (None: it can)."""
    absent = [c for c in NEEDED if shutil.which(c) is None]
    if absent:
        return f"{', '.join(absent)} not installed (Debian: apt-get install slurm-wlm munge; scripts/setup.sh does as root)"
    if os.geteuid() != 0:
        return "slurmd must run as root to start jobs as their user"
    return None


def processes_with(var: str, value: str) -> list[psutil.Process]:
    """Processes whose environment sets `var` to `value` (slurmstepd daemonizes: a job's processes are no
    descendants of anything the test started)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(var) == value:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


@dataclass
class SlurmIsland:
    root: Path
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    def start(self) -> None:
        r = self.root
        (r / "state").mkdir(parents=True)
        (r / "spool").mkdir()
        os.chmod(r, 0o700)
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = r / "munge.sock"
        subprocess.run(["munged", f"--socket={sock}", f"--key-file={key}", f"--pid-file={r / 'munged.pid'}",
                        f"--log-file={r / 'munged.log'}", f"--seed-file={r / 'munged.seed'}", "--force"],
                       check=True, capture_output=True, timeout=30)
        host = socket.gethostname()
        conf = f"""ClusterName=elasticdtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
AuthType=auth/munge
AuthInfo=socket={sock}
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd.pid'}
SlurmctldLogFile={r / 'slurmctld.log'}
SlurmdLogFile={r / 'slurmd.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SchedulerType=sched/builtin
KillWait=30
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
NodeName={NODE} NodeHostname={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        (r / "slurm.conf").write_text(conf)
        for cmd in (["slurmctld", "-D", "-f", str(r / "slurm.conf")],
                    ["slurmd", "-D", "-f", str(r / "slurm.conf"), "-N", NODE]):
            self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL,
                                               stderr=subprocess.DEVNULL, start_new_session=True))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True)
            if out.stdout.strip() == "idle":
                return
            time.sleep(0.2)
        raise RuntimeError(f"slurm did not come up: {(r / 'slurmctld.log').read_text()[-2000:]}")

    def sbatch(self, *args: str, env: dict[str, str] | None = None) -> str:
        out = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})}, capture_output=True,
                             text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip().split(";")[0]

    def job_state(self, job: str) -> str:
        out = subprocess.run(["scontrol", "show", "job", job], env=self.env, capture_output=True, text=True)
        for word in out.stdout.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return "GONE"   # forgotten by slurmctld (MinJobAge)

    def wait_job(self, job: str, done: tuple[str, ...], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state in done:
                return state
            time.sleep(0.2)
        raise AssertionError(f"Slurm job {job} still {self.job_state(job)} after {timeout:.0f}s")

    def _ours(self) -> list[psutil.Process]:
        """Every process this Slurm started, told by the SLURM_CONF it passed on: its daemons, slurmstepd
        and whatever a job left (a job's processes outlive a batch script that hung)."""
        return processes_with("SLURM_CONF", str(self.root / "slurm.conf"))

    def stop(self) -> None:
        for p in self._ours():
            if p.pid not in {q.pid for q in self.procs}:
                try:
                    p.kill()
                except psutil.Error:
                    pass
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        pid_file = self.root / "munged.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass
