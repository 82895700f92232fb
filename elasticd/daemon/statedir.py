"""Where a daemon or scheduler keeps its files, and how the CLI finds it.

    STATE_DIR/                 mode 0700
      daemon.sock              the local daemon's CLI socket (IPC, 0600)
      agents.sock              the local daemon's agent socket (IPC, 0600)
      scheduler.sock           a standalone scheduler's local socket (IPC, 0600)
      daemon.json              written once the daemon serves: pid, node id, endpoints, public key
      scheduler.json           the same for a standalone scheduler
      scheduler.db             the island scheduler's job table (SQLite)
      keys/                    CURVE identity and allow-list (see elasticd.keys)
      logs/<job>/rank<p>.log   stdout+stderr of each local agent
      errors/<job>/rank<p>.json  a failing agent's error report
      snapshots/               only when the host has no tmpfs at /dev/shm (see `snapshot_root`)
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_VAR = "ELASTICD_STATE_DIR"


def default_state_dir() -> Path:
    return Path(os.environ.get(ENV_VAR) or Path.home() / ".elasticd").expanduser()


@dataclass(frozen=True, slots=True)
class StateDir:
    root: Path

    @classmethod
    def resolve(cls, path: str | os.PathLike[str] | None) -> StateDir:
        return cls(Path(path).expanduser().absolute() if path else default_state_dir().absolute())

    def create(self) -> StateDir:
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o700)
        return self

    @property
    def daemon_sock(self) -> Path:
        return self.root / "daemon.sock"

    @property
    def agents_sock(self) -> Path:
        return self.root / "agents.sock"

    @property
    def scheduler_sock(self) -> Path:
        return self.root / "scheduler.sock"

    @property
    def daemon_info(self) -> Path:
        return self.root / "daemon.json"

    @property
    def scheduler_info(self) -> Path:
        return self.root / "scheduler.json"

    @property
    def db(self) -> Path:
        return self.root / "scheduler.db"

    @property
    def lock(self) -> Path:
        return self.root / "lock"

    def log_dir(self, job_id: str) -> Path:
        return self.root / "logs" / safe_name(job_id)

    def error_dir(self, job_id: str) -> Path:
        return self.root / "errors" / safe_name(job_id)

    @property
    def snapshot_root(self) -> Path:
        """Where this daemon's agents keep resize snapshots (agent.fallback): tmpfs, i.e. host memory, so a
        resize never waits on a disk. One directory per state dir, so two daemons on a host stay apart."""
        shm = Path("/dev/shm")
        if shm.is_dir() and os.access(shm, os.W_OK):
            tag = hashlib.sha1(str(self.root).encode()).hexdigest()[:10]
            return shm / f"elasticd-{os.getuid()}-{tag}"
        return self.root / "snapshots"

    def snapshot_dir(self, job_id: str) -> Path:
        return self.snapshot_root / safe_name(job_id)


def safe_name(job_id: str) -> str:
    """A job id as a single path component (ids come from the scheduler, i.e. from the network)."""
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in job_id)[:64]
    return cleaned.lstrip(".") or "_"


def write_info(path: Path, info: dict[str, Any]) -> None:
    """Write atomically, so a reader sees either nothing or the whole file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(info, indent=1))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def read_info(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def pid_alive(pid: int) -> bool:
    """A running process (a zombie, i.e. exited but not yet reaped by its parent, does not count)."""
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True
