"""The private directories of one `elasticd run`, named for its pid so that the next run sweeps what a killed
one left behind (tmpfs keeps files until a reboot)."""

from __future__ import annotations

import os
import re
import shutil
import tempfile

import psutil


def tmpfs_root() -> str:
    """Host memory, not a disk, where the host has it writable: snapshots are written there at every resize."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def private_dir(root: str) -> str:
    """A fresh directory of this run's in `root`. Its name carries this process's pid, so that what a killed
    `elasticd run` left behind is swept by the next one: directories of this user's there whose run is gone."""
    for name in os.listdir(root):
        m = re.fullmatch(r"elasticd-run-(\d+)-\w+", name)
        path = os.path.join(root, name)
        try:
            mine = os.stat(path).st_uid == os.getuid()
        except OSError:   # swept by another run meanwhile
            continue
        if m and mine and not psutil.pid_exists(int(m.group(1))):
            shutil.rmtree(path, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"elasticd-run-{os.getpid()}-", dir=root)
