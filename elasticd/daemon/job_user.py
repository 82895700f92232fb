"""Which Unix user a job's agents run as, and the files a daemon shares with them.

A job is untrusted code. A daemon running as root never runs it as root unless told to: each job runs as
the user its owner's key maps to (`elasticd keygen --allow KEY --run-as USER`), or as the node's default
(`elasticd start --jobs-as USER`, `elasticd-job` unless said otherwise). Such an agent cannot read the
state dir (0700: keys, the job table, other jobs' logs) nor open `daemon.sock` (0600), where a peer counts
as admin. What it needs lives in the agents' area outside the state dir (`StateDir.agent_root`): the agent
socket, where it proves itself with its own token, and its job's directory, which it owns.

A daemon running as an ordinary user cannot switch users: its jobs run as that user and are as trusted as
it is (docs/security.md says so plainly).

Files agents own are read by the daemon with elasticd.core.files.read_regular: never through a link, only
regular files of the agent's user, a bounded number of bytes.
"""

from __future__ import annotations

import os
import pwd
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from elasticd.core.errors import ControlPlaneError
from elasticd.protocol.limits import bad_user_name

DEFAULT_JOB_USER = "elasticd-job"
CREATE_HINT = (f"useradd --system --user-group --create-home --home-dir /var/lib/{DEFAULT_JOB_USER} "
               f"--shell /usr/sbin/nologin {DEFAULT_JOB_USER}")


class JobUserError(ControlPlaneError, ValueError):
    """No such user here, or a daemon that cannot switch to it."""


@dataclass(frozen=True, slots=True)
class JobUser:
    name: str
    uid: int
    gid: int
    groups: tuple[int, ...]
    home: str

    @property
    def switched(self) -> bool:
        """Agents run as another user than the daemon's."""
        return self.uid != os.geteuid()

    def env(self) -> dict[str, str]:
        """What a login as this user would set, so that caches land in its home, not the daemon's."""
        return {"HOME": self.home, "USER": self.name, "LOGNAME": self.name}


def lookup(name: str) -> JobUser:
    """Raises:
        JobUserError: a malformed name or no such user on this machine.
    """
    why = bad_user_name(name)
    if why:
        raise JobUserError(why)
    try:
        pw = pwd.getpwnam(name)
    except KeyError:
        hint = f" (create it: {CREATE_HINT})" if name == DEFAULT_JOB_USER else ""
        raise JobUserError(f"no user {name!r} on this machine{hint}") from None
    return _user(pw)


def _user(pw: pwd.struct_passwd) -> JobUser:
    return JobUser(pw.pw_name, pw.pw_uid, pw.pw_gid, tuple(os.getgrouplist(pw.pw_name, pw.pw_gid)), pw.pw_dir)


def blocked_at(path: str, user: JobUser) -> str | None:
    """The first directory on the way to `path` that `user` may not pass through (None: it may pass all)."""
    parts = Path(os.path.realpath(path)).parents
    for d in reversed(parts):
        try:
            st = os.stat(d)
        except OSError:
            return str(d)
        bit = stat.S_IXUSR if st.st_uid == user.uid else stat.S_IXGRP if st.st_gid in user.groups else stat.S_IXOTH
        if not st.st_mode & bit:
            return str(d)
    return None


def runnable_paths() -> list[tuple[str, str]]:
    """What an agent's user must reach to start an agent: the interpreter, its standard library, the
    packages of this environment (torch, pyzmq) and elasticd (an editable install lives elsewhere)."""
    import sysconfig

    import elasticd

    return [("the Python interpreter", sys.executable), ("its standard library", os.__file__),
            ("the installed packages", os.path.join(sysconfig.get_paths()["purelib"], "-")),
            ("elasticd", elasticd.__file__)]


def check_runnable(user: JobUser) -> None:
    """Raises:
        JobUserError: `user` could not start this Python and elasticd (an interpreter under /root, say).
    """
    for what, path in runnable_paths():
        where = blocked_at(path, user)
        if where is not None:
            raise JobUserError(
                f"jobs run as {user.name!r}, who cannot reach {what} ({os.path.realpath(path)}): {where} is closed "
                f"to it. Install Python and elasticd where other users can run them, let them pass through "
                f"(chmod o+x {where}; scripts/setup.sh does), or choose the user with --jobs-as")


def check_cwd(cwd: str, user: JobUser) -> None:
    """Raises:
        JobUserError: `user` may not enter the job's working directory (a job submitted from a home
            directory closed to others), which a cold start and a spare would each find out later, apart.
    """
    where = blocked_at(os.path.join(cwd, "-"), user)
    if where is not None:
        raise JobUserError(f"the job runs as {user.name!r}, who cannot enter its working directory {cwd} ({where} "
                           "is closed to it): submit from a directory that user can read")


def own() -> JobUser:
    """This process's user, whatever its name (a directory service may allow names `lookup` refuses)."""
    return _user(pwd.getpwuid(os.geteuid()))


def can_switch() -> bool:
    return os.geteuid() == 0


def node_default(requested: str | None) -> JobUser:
    """The user a daemon runs jobs as when their owner's key names none (`start --jobs-as`).

    Raises:
        JobUserError: the user does not exist, or this daemon cannot switch to it.
    """
    if requested is None:
        if not can_switch():
            return own()
        try:
            user = lookup(DEFAULT_JOB_USER)
        except JobUserError:
            raise JobUserError(
                f"this daemon runs as root and runs jobs as {DEFAULT_JOB_USER!r}, which does not exist here: create "
                f"it ({CREATE_HINT}; scripts/setup.sh does) or name another with --jobs-as USER (--jobs-as root "
                "runs every job as root: any job owner is then root on this node)") from None
        check_runnable(user)
        return user
    return _usable(requested, f"--jobs-as {requested}: this daemon runs as {own().name} and can run jobs only "
                              "as itself (start it as root to run jobs as other users)")


def for_job(run_as: str, default: JobUser) -> JobUser:
    """The user to run a job's agents as: the one its owner's key maps to, else the node's default.

    Raises:
        JobUserError: the user does not exist here, or this daemon cannot switch to it.
    """
    if not run_as or run_as == default.name:
        return default
    return _usable(run_as, f"the job runs as {run_as!r}, but this node's daemon runs as {own().name} and can run "
                           "jobs only as itself")


def _usable(name: str, cannot_switch: str) -> JobUser:
    """`name` as a user this daemon can run jobs as (`cannot_switch`: why not, when it is not root)."""
    user = lookup(name)
    if user.switched and not can_switch():
        raise JobUserError(cannot_switch)
    if user.switched:
        check_runnable(user)
    return user


def own_dir(path: Path, user: JobUser) -> None:
    """Make `path` (in a directory only the daemon writes) a 0700 directory owned by `user`.

    Raises:
        OSError: it exists as something other than a directory.
    """
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{path} exists and is not a directory")
    if (st.st_uid, st.st_gid) != (user.uid, user.gid):
        os.chown(path, user.uid, user.gid, follow_symlinks=False)
    os.chmod(path, 0o700)
