"""How the control plane starts a runtime process."""

from __future__ import annotations

import sys


def module_command(module: str = "elasticd.agent") -> list[str]:
    """The command line that starts `python -m module` so that the user's files cannot shadow ours.

    `-m` puts the current directory first on sys.path, where a job's own `elasticd.py` or `torch.py`
    would win; safe-path mode (`-P`) leaves it out. The user's script directory is added when the
    script is loaded (`elasticd.agent.script`), as `python script.py` would.
    """
    return [sys.executable, "-P", "-m", module]

