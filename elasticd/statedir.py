"""Where a daemon or scheduler keeps its files, and how the CLI finds it.

    STATE_DIR/                 mode 0700
      daemon.sock              the local daemon's CLI socket (IPC, 0600)
      scheduler.sock           a standalone scheduler's local socket (IPC, 0600)
      daemon.json              written once the daemon serves: pid, node id, endpoints, public key
      scheduler.json           the same for a standalone scheduler
      scheduler.db             the island scheduler's job table (SQLite)
      keys/                    CURVE identity and allow-list (see elasticd.keys)
      logs/<job>/rank<p>.log   stdout+stderr of each local agent

    AGENT_ROOT/                the agents' area, outside the state dir (`StateDir.agent_root`): 0700, or
                               0711 when the daemon runs as root (jobs run as other users)
      agents.sock              the local daemon's agent socket (IPC; 0600, or 0666 with per-agent tokens)
      <job>/                   owned by the user the job runs as: its resize and periodic snapshots,
                               each agent's error report (rank<p>.json) and beat file (.beat)

The state dir trusts no one but its user (sshd's StrictModes, gpg's "unsafe ownership"): a daemon
refuses to start when the dir is owned by another user or writable by group or others, or when a
parent directory is writable by someone other than root and this user (unless it is sticky, like
/tmp). Otherwise whoever could write there could plant a key on the allow-list or a symlink where the
daemon writes its log.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elasticd.core.errors import ControlPlaneError

ENV_VAR = "ELASTICD_STATE_DIR"


class UnsafeStateDir(ControlPlaneError, RuntimeError):
    """The state dir, or a directory above it, could be written by someone other than this user."""


def unsafe_dir(st: os.stat_result, *, own: bool, uid: int | None = None) -> str | None:
    """Why a directory cannot be trusted (None: it can).

    `own`: the state dir itself, which must belong to this user and be writable by nobody else. A
    parent may also belong to root, and may be writable by others only when sticky (only a file's owner
    may then rename or delete it, as in /tmp).
    """
    uid = os.geteuid() if uid is None else uid
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    owners = (uid,) if own else (uid, 0)
    if st.st_uid not in owners:
        return f"owned by uid {st.st_uid}, not by this user (uid {uid})" + ("" if own else " or root")
    loose = st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
    if loose and (own or not st.st_mode & stat.S_ISVTX):
        who = "group and others" if loose == (stat.S_IWGRP | stat.S_IWOTH) else (
            "its group" if loose & stat.S_IWGRP else "others")
        return f"writable by {who} (mode {stat.S_IMODE(st.st_mode):04o})"
    return None


def check_dirs(root: Path) -> None:
    """Raises:
        UnsafeStateDir: naming the first directory (the state dir, then each parent) that fails `unsafe_dir`.
    """
    real = Path(os.path.realpath(root))
    chain = [real, *real.parents]
    for i, d in enumerate(chain):
        try:
            st = os.stat(d)
        except FileNotFoundError:
            continue   # we are about to create it
        why = unsafe_dir(st, own=(i == 0))
        if why:
            what = f"the state dir {d}" if i == 0 else f"{d} (a parent of the state dir {real})"
            raise UnsafeStateDir(f"refusing to use {what}: it is {why}; anyone who can write there could plant "
                                 "keys or links the daemon would trust. Fix its ownership/mode or use another "
                                 "--state-dir")


def default_state_dir() -> Path:
    return Path(os.environ.get(ENV_VAR) or Path.home() / ".elasticd").expanduser()


@dataclass(frozen=True, slots=True)
class StateDir:
    root: Path

    @classmethod
    def resolve(cls, path: str | os.PathLike[str] | None) -> StateDir:
        return cls(Path(path).expanduser().absolute() if path else default_state_dir().absolute())

    def create(self) -> StateDir:
        """Make the dir (0700) after checking that no one else can write it or a parent.

        Raises:
            UnsafeStateDir: see `check_dirs`.
        """
        check_dirs(self.root)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.root, 0o700)
        return self

    @property
    def daemon_sock(self) -> Path:
        return self.root / "daemon.sock"

    @property
    def agents_sock(self) -> Path:
        return self.agent_root / "agents.sock"

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
    def federation_sock(self) -> Path:
        return self.root / "federation.sock"

    @property
    def federation_info(self) -> Path:
        return self.root / "federation.json"

    @property
    def db(self) -> Path:
        return self.root / "scheduler.db"

    @property
    def lock(self) -> Path:
        return self.root / "lock"

    def log_dir(self, job_id: str) -> Path:
        return self.root / "logs" / safe_name(job_id)

    @property
    def agent_root(self) -> Path:
        """The agents' area: what this daemon's agents reach, kept outside the state dir so that agents
        running as another user reach it and nothing else (elasticd/daemon/job_user.py). On tmpfs, i.e.
        host memory, so that a resize never waits on a disk for its snapshots (agent.fallback). One per
        state dir, so two daemons on a host stay apart."""
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
        tag = hashlib.sha1(str(self.root).encode()).hexdigest()[:10]
        return base / f"elasticd-{os.getuid()}-{tag}"

    def job_dir(self, job_id: str) -> Path:
        """A job's directory in the agents' area: its snapshots, error reports and beat files."""
        return self.agent_root / safe_name(job_id)

    def snapshot_dir(self, job_id: str) -> Path:
        """Where a job's agents save their resize and periodic snapshots: its job directory."""
        return self.job_dir(job_id)

    def span_snapshot_dir(self, key: str) -> Path:
        """Where the agents of a portion of a job spanning islands save its periodic snapshots: under the
        job's key, the same for each of its attempts, so a restart finds what an earlier one saved."""
        return self.agent_root / f"span-{safe_name(key)}"


def default_node_id(sd: StateDir) -> str:
    """Stable across restarts of the same state dir, distinct for two daemons on one host (what a node
    key is bound to with `keygen --allow --role node --node-id`, unless `start --node-id` names another)."""
    return f"{socket.gethostname()}-{hashlib.sha1(str(sd.root).encode()).hexdigest()[:6]}"


def safe_name(job_id: str) -> str:
    """A job id as a single path component (ids come from the scheduler, i.e. from the network)."""
    cleaned = "".join(c if c.isalnum() or c in "-_." else "_" for c in job_id)[:64]
    return cleaned.lstrip(".") or "_"


def write_info(path: Path, info: dict[str, Any]) -> None:
    """Write atomically, so a reader sees either nothing or the whole file."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.unlink(missing_ok=True)   # O_EXCL below: never write through something already there
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(json.dumps(info, indent=1))
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
