"""The agents of a job share one stdout and stderr (a pipe to `elasticd run`, a node's job log): what
workers print arrives in whole lines, never one agent's text and another's newline spliced together, even
with PYTHONUNBUFFERED set (as the daemon sets it for agents, so that output shows at once)."""

from __future__ import annotations

import re
from pathlib import Path

from util import cli

LINES = 300
SCRIPT = f"""
import sys
import elasticd

@elasticd.elastic(workers=4)
def train(ctx):
    for i in range({LINES}):
        print(f"rank {{ctx.rank}} line {{i}} " + "x" * 100)
        print(f"rank {{ctx.rank}} err {{i}} " + "y" * 100, file=sys.stderr)

if __name__ == "__main__":
    train()
"""


def test_lines_printed_by_workers_on_two_agents_arrive_whole(tmp_path: Path) -> None:
    script = tmp_path / "chatty.py"
    script.write_text(SCRIPT)
    run = cli("run", str(script), "--devices", "2", env={"PYTHONUNBUFFERED": "1"}, cwd=tmp_path, timeout=240)
    assert run.code == 0, run.output
    for stream, text, word, fill in (("stdout", run.out, "line", "x"), ("stderr", run.err, "err", "y")):
        whole = re.compile(rf"rank (\d) {word} (\d+) {fill}{{100}}")
        got = [line for line in text.splitlines() if line.startswith("rank ") or f" {word} " in line]
        spliced = [line for line in got if not whole.fullmatch(line)]
        assert not spliced, f"{stream}: {len(spliced)} lines spliced, e.g. {spliced[:2]}"
        assert sorted(tuple(map(int, whole.fullmatch(line).groups())) for line in got) == [  # type: ignore[union-attr]
            (r, i) for r in range(4) for i in range(LINES)], f"{stream}: lines lost or repeated"
