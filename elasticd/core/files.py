"""Reading files that a less trusted process writes: agents' error reports and beat files, in directories
their agents own (elasticd/daemon/job_user.py). Such a file is read as its writer could have read it and no
further: never through a link, never a FIFO or device (which could block the reader), only a regular file,
owned by the writer's user when that is known, and a bounded number of bytes."""

from __future__ import annotations

import os
import stat


def read_regular(path: str | os.PathLike[str], limit: int, owner: int | None = None) -> bytes | None:
    """At most `limit` bytes of the regular file at `path` (owned by uid `owner`, unless None); None when
    there is no such file. A link to /etc/shadow, a hard link to another user's file or a FIFO gets None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (owner is not None and st.st_uid != owner):
            return None
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)
