"""A decorated script's own arguments: `elasticd run SCRIPT ARGS` gives its top level `sys.argv` as
`python SCRIPT ARGS` does, in the agents and under `--ddp`, and N comes from the decorator's source without
running the script in the CLI's process (its top level runs once per agent, as under DDP once per rank)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from util import JOBS, cli

from elasticd.core.script_source import declared_workers

SCRIPT = JOBS / "argv_job.py"


@pytest.mark.parametrize("how, tops", [(("--devices", "1"), 1), (("--devices", "2"), 2), (("--ddp",), 2)])
def test_the_scripts_top_level_parses_its_own_arguments(tmp_path: Path, how: tuple[str, ...], tops: int) -> None:
    out = tmp_path / "r"
    r = cli("run", *how, str(SCRIPT), "--lr", "0.5", "--out", str(out), timeout=180)
    assert r.code == 0, r.output
    for rank in range(2):
        got = json.loads(Path(f"{out}{rank}.json").read_text())
        assert got == {"argv": ["--lr", "0.5", "--out", str(out)], "lr": 0.5, "world": 2}, got
    # once per agent (per rank under DDP), never in the CLI's own process
    assert len(Path(f"{out}.tops").read_text().split()) == tops


def test_workers_read_from_the_decorator_source(tmp_path: Path) -> None:
    def n(src: str, func: str | None = None) -> int | None:
        path = tmp_path / "s.py"
        path.write_text(src)
        return declared_workers(str(path), func)

    assert n("import elasticd\n@elasticd.elastic(workers=8)\ndef f(ctx): pass\n") == 8
    assert n("from elasticd import elastic\n@elastic(3, deterministic=True)\ndef f(ctx): pass\n") == 3
    deco = "@elasticd.elastic(workers=N)\ndef f(ctx): pass\n"
    assert n(f"import elasticd\nN = 4\n{deco}") == 4   # a name bound once, to a literal, above the decorator
    for computed in ("N = int(os.environ.get('N', '4'))\n",   # N what the environment says
                     "N = 4\nN = 8\n",                      # bound twice
                     "if os.environ.get('BIG'):\n    N = 4\n",   # conditionally
                     "from cfg import *\nN = 4\n",          # perhaps by the star import too
                     "N = True\n",                           # not an int
                     "N = 4\ndef g():\n    global N\n    N = 2\n",   # rebound by a function
                     "M = 4\nN = M\n"):                     # a name for a name: left to the import
        assert n(f"import os\nimport elasticd\n{computed}{deco}") is None, computed
    assert n(f"import elasticd\n{deco}N = 4\n") is None   # bound after the decorator runs: a NameError
    assert n(f"import elasticd\nN = 4\n{deco}def g(N=2): pass\n") is None   # a parameter of that name elsewhere
    two = "import elasticd\n@elasticd.elastic(workers=2)\ndef f(ctx): pass\n@elasticd.elastic(workers=6)\ndef g(ctx): pass\n"
    assert n(two) is None and n(two, "g") == 6 and n(two, "h") is None
