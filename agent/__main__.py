"""`python -m agent ...`: one agent process. Exit 0 when every hosted worker returned, 1 when one raised.

`python -m agent --workers-of FD SCRIPT FUNC [ARGS...]` writes N as SCRIPT's @elastic function declares it
to descriptor FD instead (FUNC "" for the only one): what `elasticd run` asks a fork of its warm fork
server when the source does not say N as a literal, so that the launcher does not import torch for it.
"""

from __future__ import annotations

import json
import os
import sys

from elasticd.agent.process_exit import run
from elasticd.core.agent_config import WORKERS_OF, parse_args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [WORKERS_OF]:
        return workers_of(int(argv[1]), argv[2], argv[3] or None, argv[4:])
    cfg = parse_args(argv)
    from elasticd.agent.process import run_agent

    return run_agent(cfg)


def workers_of(fd: int, script: str, func: str | None, args: list[str]) -> int:
    """Write `{"workers": N}` for SCRIPT's @elastic function to `fd`, or `{"error": why}` where the script
    holds no unambiguous one (exit 2). An exception the script's top level raises goes out with its
    traceback on stderr and nothing on `fd` (exit 1), as from `python SCRIPT`."""
    from elasticd.agent.script import ScriptError, load_function

    sys.argv = [os.path.abspath(script), *args]   # as `python SCRIPT ARGS` has them: a top level may parse them
    with os.fdopen(fd, "w") as answer:
        try:
            workers = load_function(script, func).workers
        except ScriptError as e:
            answer.write(json.dumps({"error": str(e)}))
            return 2
        answer.write(json.dumps({"workers": workers}))
    return 0


if __name__ == "__main__":
    run(main)
