"""What runs inside a training process: the time-slicer and the worker contexts.

One agent process per (job, device) hosts a contiguous block of logical ranks, runs each in its own
thread, and passes a baton so exactly one runs at a time (see docs/architecture.md).

This package imports nothing: the daemon and the scheduler read its torch-free parts (`config`,
`resize.parts`) without paying for torch.
"""

from __future__ import annotations

import sys


def module_command(module: str = "elasticd.agent") -> list[str]:
    """The command line that starts `python -m module` so that the user's files cannot shadow ours.

    `-m` puts the current directory first on sys.path, where a job's own `elasticd.py` or `torch.py`
    would win; safe-path mode (`-P`) leaves it out. The user's script directory is added when the
    script is loaded (`elasticd.agent.script`), as `python script.py` would.
    """
    return [sys.executable, "-P", "-m", module]

